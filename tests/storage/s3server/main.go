// The S3 server of dpserve's storage tests (tests/storage/s3.py): versitygw's posix
// backend behind its embeddable gateway package, the one the upstream command runs.
// That command also links its Azure, S3-proxy and ScoutFS backends, plugin loading and
// its own integration suite; leaving them out halves the binary and shortens a cold
// build (docs/test-storage.md).
//
//	ROOT_ACCESS_KEY_ID=... ROOT_SECRET_ACCESS_KEY=... s3server --listen 127.0.0.1:7070 DIR
//
// The root credentials come from the environment so they never show in a process
// listing. It serves until SIGINT or SIGTERM.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/versity/versitygw/backend/meta"
	"github.com/versity/versitygw/backend/posix"
	"github.com/versity/versitygw/embedgw"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:7070", "address to serve S3 on, host:port")
	region := flag.String("region", "us-east-1", "the region clients sign for")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: s3server [--listen HOST:PORT] [--region REGION] DIR")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() != 1 {
		flag.Usage()
		os.Exit(2)
	}
	if err := serve(flag.Arg(0), *listen, *region); err != nil {
		fmt.Fprintln(os.Stderr, "s3server:", err)
		os.Exit(1)
	}
}

func serve(dir, listen, region string) error {
	access, secret := os.Getenv("ROOT_ACCESS_KEY_ID"), os.Getenv("ROOT_SECRET_ACCESS_KEY")
	if access == "" || secret == "" {
		return fmt.Errorf("set ROOT_ACCESS_KEY_ID and ROOT_SECRET_ACCESS_KEY to the credentials to accept")
	}
	// Metadata, ETags and checksums live in extended attributes of each object's file.
	if err := (meta.XattrMeta{}).Test(dir); err != nil {
		return fmt.Errorf("%s cannot hold extended attributes: %w", dir, err)
	}
	be, err := posix.New(dir, meta.XattrMeta{}, posix.PosixOpts{})
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return embedgw.RunVersityGW(ctx, be, &embedgw.Config{
		RootUserAccess:    access,
		RootUserSecret:    secret,
		Region:            region,
		Ports:             []string{listen},
		MaxConnections:    1000,
		MaxRequests:       1000,
		MultipartMaxParts: 10000, // S3's own limit
		Quiet:             true,
	})
}
