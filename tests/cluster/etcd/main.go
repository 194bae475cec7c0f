// etcd server for dpserve's local test cluster; built by ../build.sh.
// Same as etcd's own main (go.etcd.io/etcd/v3/main.go): all of etcd lives in etcdmain.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
