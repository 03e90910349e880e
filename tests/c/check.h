/* check.h: the harness shared by the plain-C unit tests in tests/c: EXPECT counts a check and
 * reports a failed one with its place and condition, OK expects a core call to return DDPC_OK,
 * check_summary ends main. Found beside the tests by #include "check.h"; no -I needed. */
#ifndef DDPC_TESTS_CHECK_H
#define DDPC_TESTS_CHECK_H

#include <stdio.h>

/* A broken conversion fails thousands of checks in a loop; the first few say what went wrong. */
#define CHECK_MAX_REPORTS 20

static long g_checks, g_failures;

#define EXPECT(cond, ...)                                                          \
    do {                                                                           \
        g_checks++;                                                                \
        if (!(cond) && g_failures++ < CHECK_MAX_REPORTS) {                         \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);        \
            fprintf(stderr, __VA_ARGS__);                                          \
            fprintf(stderr, "\n");                                                 \
        }                                                                          \
    } while (0)

/* A core call that must succeed; on failure the core's message is printed. */
#define OK(call) EXPECT((call) == DDPC_OK, "%s", ddpc_last_error())

/* Prints the outcome under the test's name; returns main's exit status. The drivers in tests/
 * look for a stdout starting "ok: " and containing "all checks passed". */
static inline int check_summary(const char *name) {
    if (g_failures) {
        fprintf(stderr, "%s: %ld of %ld checks failed", name, g_failures, g_checks);
        if (g_failures > CHECK_MAX_REPORTS)
            fprintf(stderr, " (the first %d shown)", CHECK_MAX_REPORTS);
        fprintf(stderr, "\n");
        return 1;
    }
    printf("ok: %s: all checks passed (%ld checks)\n", name, g_checks);
    return 0;
}

#endif
