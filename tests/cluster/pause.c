/*
 * PID 1 of a test pod's sandbox (the image containerd's sandbox_image names).
 *
 * It only has to exist: the pod's namespaces live as long as it does. As the init
 * of the pod's PID namespace (when containers share it) it inherits orphans and
 * must reap them, or they stay zombies; and the kernel delivers no signal to a PID
 * 1 that has no handler for it, so TERM and INT are waited for explicitly.
 *
 * Built statically (gcc -static) so the image needs nothing beside it.
 */
#include <signal.h>
#include <stdio.h>
#include <sys/types.h>
#include <sys/wait.h>

int main(void) {
    sigset_t wanted;
    sigemptyset(&wanted);
    sigaddset(&wanted, SIGCHLD);
    sigaddset(&wanted, SIGTERM);
    sigaddset(&wanted, SIGINT);
    /* Blocked signals stay pending until sigwait takes them: none is lost
       between two waits, and no handler runs at an awkward moment. */
    if (sigprocmask(SIG_BLOCK, &wanted, NULL) != 0) {
        perror("pause: sigprocmask");
        return 1;
    }
    for (;;) {
        int sig = 0;
        if (sigwait(&wanted, &sig) != 0) {
            continue;
        }
        if (sig != SIGCHLD) {
            return 0; /* SIGTERM or SIGINT: the sandbox is being stopped */
        }
        /* One SIGCHLD may stand for many exits: reap until none is left. */
        while (waitpid(-1, NULL, WNOHANG) > 0) {
        }
    }
}
