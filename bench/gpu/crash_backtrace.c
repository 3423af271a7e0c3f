/*
 * LD_PRELOAD for the GPU check: on SIGSEGV, SIGBUS, SIGILL, SIGFPE or SIGABRT, print the
 * native stack (glibc's backtrace) to stderr, then die of the same signal. The device
 * machine has no gdb, and Python's faulthandler shows only Python frames; it chains to
 * the handler that was there before it, which is this one.
 *
 *   gcc -shared -fPIC -O1 -o /tmp/crash_backtrace.so bench/gpu/crash_backtrace.c
 *   LD_PRELOAD=/tmp/crash_backtrace.so python -X faulthandler ...
 */
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void on_fatal(int number)
{
    static const char header[] = "\n== native backtrace (bench/gpu/crash_backtrace.c) ==\n";
    void *frames[64];
    int count = backtrace(frames, 64);
    (void)!write(STDERR_FILENO, header, sizeof header - 1);
    backtrace_symbols_fd(frames, count, STDERR_FILENO);
    signal(number, SIG_DFL);
    raise(number);
}

__attribute__((constructor)) static void install(void)
{
    static const int fatal[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
    void *warm[1];
    backtrace(warm, 1); /* loads libgcc now, not inside a signal handler */
    for (size_t i = 0; i < sizeof fatal / sizeof fatal[0]; i++) {
        struct sigaction action;
        memset(&action, 0, sizeof action);
        action.sa_handler = on_fatal;
        sigaction(fatal[i], &action, NULL);
    }
}
