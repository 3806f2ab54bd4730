/* Shifts a process's wall clock (LD_PRELOAD) by the milliseconds written in the file
 * LLMRL_CLOCK_OFFSET_FILE names, read at every clock read: an end-to-end test starts
 * Redis, Envoy and the CLI on the real time, then moves all of them at once to a few
 * seconds before a calendar boundary. Only the wall clock moves (CLOCK_REALTIME and its
 * coarse variant, gettimeofday, time); the monotonic clocks that timers use do not.
 *
 * libfaketime is the usual tool, but its initialisation recurses under redis-server's
 * jemalloc ("Unexpected recursive calls to clock_gettime()") and Redis does not start;
 * this shim reads the clock with the system call itself and touches no allocator. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static long long offset_ms(void) {
    const char *path = getenv("LLMRL_CLOCK_OFFSET_FILE");
    if (!path) {
        return 0;
    }
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
        return 0;
    }
    char text[32] = {0};
    ssize_t got = read(fd, text, sizeof text - 1);
    close(fd);
    return got > 0 ? strtoll(text, NULL, 10) : 0;
}

static void shift(struct timespec *ts) {
    long long offset = offset_ms();
    long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + offset * 1000000LL;
    ts->tv_sec = ns / 1000000000LL;
    ts->tv_nsec = ns % 1000000000LL;
}

int clock_gettime(clockid_t clock, struct timespec *ts) {
    int result = (int)syscall(SYS_clock_gettime, clock, ts);
    if (result == 0 && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE)) {
        shift(ts);
    }
    return result;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    int result = clock_gettime(CLOCK_REALTIME, &ts);
    if (result == 0) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    (void)tz;
    return result;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out) {
        *out = ts.tv_sec;
    }
    return ts.tv_sec;
}
