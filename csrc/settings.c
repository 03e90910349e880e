/* The DDPC_* environment settings: one table of every name ddpc reads, and the parsers every
 * reader goes through. A value means the same to every reader, and one that is not a setting is
 * refused with what the setting takes instead of silently meaning its default.
 * ddpc_group_create checks them all before it starts anything (ddpc_settings_check).
 * NCCL_P2P_DISABLE and NCCL_P2P_LEVEL are NCCL's settings; ddpc reads them the way NCCL does
 * (ddpc_nccl_p2p_off). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common.h"

enum {
    KIND_FLAG = DDPC_SETTING_FLAG,
    KIND_UINT = DDPC_SETTING_UINT,
    KIND_NUMBER = DDPC_SETTING_NUMBER,
    KIND_CHOICE = DDPC_SETTING_CHOICE,
    KIND_LOGLEVEL = DDPC_SETTING_LOGLEVEL,
    KIND_TEXT = DDPC_SETTING_TEXT
};

typedef struct {
    const char *name;
    int kind;
    double lo, hi;          /* KIND_UINT, KIND_NUMBER: the range, both ends included */
    const char *choices[4]; /* KIND_CHOICE: the values, the default first */
    const char *about;      /* what it does, for error messages and the doctor */
} Setting;

static const Setting SETTINGS[] = {
    {"DDPC_FAST_ALLREDUCE", KIND_FLAG, 0, 0, {NULL},
     "1 (the default): small GPU all-reduces between ranks of one host take ddpc's one-shot "
     "kernel; 0: they go through NCCL"},
    {"DDPC_STAGED_ALLREDUCE", KIND_FLAG, 0, 0, {NULL},
     "1: GPU all-reduces of DDPC_STAGED_MIN_BYTES or more go through pinned host memory on the "
     "copy engines; 0: through NCCL; unset: 1 when NCCL_P2P_DISABLE=1 or NCCL_P2P_LEVEL=LOC"},
    {"DDPC_STAGED_OVERLAP", KIND_FLAG, 0, 0, {NULL},
     "1 (the default): a staged all-reduce on a buffer no queued collective touches starts "
     "before the calls ahead of it finish; 0: each waits for the one before"},
    {"DDPC_GRAD_BATCH", KIND_FLAG, 0, 0, {NULL},
     "1 (the default): a bucket's gradients are copied or cast in one launch once the bucket is "
     "complete; 0: each as it arrives"},
    {"DDPC_NCCL_POST_THREAD", KIND_FLAG, 0, 0, {NULL},
     "1 (the default): the gradient buckets' collectives are issued by ddpc's posting thread; "
     "0: by the thread that runs the gradient hooks"},
    {"DDPC_COMM_CASTS", KIND_FLAG, 0, 0, {NULL},
     "1: bf16/fp16 buckets are cast to and from the wire on the communication stream, around "
     "each all-reduce; 0 (the default): to the wire on the backward's stream and back at the "
     "end of backward"},
    {"DDPC_QUIET_TOKEN_WARNING", KIND_FLAG, 0, 0, {NULL},
     "1: no warning when a job of several ranks has no DDPC_TOKEN; 0 (the default): the "
     "warning"},
    {"DDPC_SHM_SLOT_BYTES", KIND_UINT, 65536, 67108864, {NULL},
     "the CPU backend's shared-memory slot per rank, in bytes; rank 0's value holds"},
    {"DDPC_STAGED_MIN_BYTES", KIND_UINT, 0, 1125899906842624.0, {NULL},
     "the smallest GPU all-reduce, in bytes, that takes the staged path (default 1048576); "
     "rank 0's value holds"},
    {"DDPC_STAGED_CHUNK_BYTES", KIND_UINT, 65536, 67108864, {NULL},
     "the staged path's chunk, in bytes (default 32 MiB / ranks); rank 0's value holds"},
    {"DDPC_SAMPLER_THREADS", KIND_UINT, 1, DDPC_SAMPLER_MAX_THREADS, {NULL},
     "the threads DistributedSampler shuffles with (default: the CPUs this process may use, "
     "at most 8)"},
    {"DDPC_NCCL_MIN_CTAS", KIND_UINT, 1, 64, {NULL},
     "the fewest CTAs (SMs) ddpc's NCCL communicator uses; needs NCCL 2.17 or newer"},
    {"DDPC_NCCL_MAX_CTAS", KIND_UINT, 1, 64, {NULL},
     "the most CTAs (SMs) ddpc's NCCL communicator uses (fewer leave more SMs to compute); "
     "needs NCCL 2.17 or newer"},
    {"DDPC_TAIL_BUCKET_MB", KIND_NUMBER, 0, 1e9, {NULL},
     "the MiB of buckets of their own for the gradients that complete last (0 or unset: "
     "none); every rank must set the same value"},
    {"DDPC_NCCL_WINDOW_MB", KIND_NUMBER, 0, 1e9, {NULL},
     "the most MiB of NCCL symmetric windows wrap_model holds the bf16/fp16 wires of its "
     "buckets in (all but the last bucket, as many as fit; 0 or unset: none; NCCL 2.27 or "
     "newer); every rank must set the same value"},
    {"DDPC_CAST_BACK", KIND_CHOICE, 0, 0, {"end", "early", "overlap", NULL},
     "end (the default): bf16/fp16 buckets are cast back to the gradients' dtype at the end of "
     "backward, on the caller's stream; early: as soon as each all-reduce is done, on a stream "
     "of their own; overlap: at the end of backward, all but the last bucket on a stream of "
     "their own, beside the last bucket's all-reduce, which is split in up to 4 parts, each "
     "cast back there as soon as its all-reduce ends; every rank must set the same value"},
    {"DDPC_DEBUG", KIND_LOGLEVEL, 0, 0, {NULL},
     "INFO (or 1): log lines with host:pid:tid; TRACE (or 2): also every collective; OFF (or "
     "0, the default): none"},
    /* Read by the Python package (ddpc._C.setting), which takes the checked value from here. */
    {"DDPC_TIMEOUT", KIND_NUMBER, 0.001, 1e9, {NULL},
     "the seconds a collective or the rendezvous may take (default 600), unless "
     "init_process_group gets a timeout"},
    {"DDPC_STALL_WARN", KIND_NUMBER, 0, 1e9, {NULL},
     "the seconds a collective may wait for the other ranks before this rank says so on its "
     "stderr, once per collective (default 60; 0: never); only when the timeout is longer"},
    {"DDPC_CPU_TRANSPORT", KIND_CHOICE, 0, 0, {"auto", "shm", "tcp", NULL},
     "how the CPU backend moves data: auto (the default: shared memory within a host, TCP "
     "across hosts), shm or tcp"},
    {"DDPC_SHARE_GPUS", KIND_FLAG, 0, 0, {NULL},
     "1: more ranks on a node than visible GPUs share them (local rank k binds GPU k modulo "
     "their count, and NCCL treats each rank as a host of its own, as it refuses two ranks on "
     "one GPU otherwise): to run or debug a multi-GPU job on fewer GPUs, slowly; 0 (the "
     "default): a local rank without a GPU of its own is an error under NCCL"},
    {"DDPC_EMBEDDING_ROWS", KIND_CHOICE, 0, 0, {"auto", "1", "0", NULL},
     "1: embedding lookups' gradients are exchanged as rows; 0: reduced densely; auto (the "
     "default): rows where NCCL's GPUs do not reach each other directly. Every rank must set "
     "the same value"},
    /* Text, read where it is used: listed so that every name ddpc reads is known here. */
    {"DDPC_BIND_ADDR", KIND_TEXT, 0, 0, {NULL},
     "the address the CPU backend's TCP transport binds (read by init_process_group)"},
    {"DDPC_TOKEN", KIND_TEXT, 0, 0, {NULL},
     "the job's secret, which the store checks (set by ddpc.launch)"},
    {"DDPC_NCCL_PATH", KIND_TEXT, 0, 0, {NULL}, "a libnccl.so.2 to load"},
    {"DDPC_NCCL_SEARCH_PATH", KIND_TEXT, 0, 0, {NULL},
     "directories to look for libnccl.so.2 in first"},
    {"DDPC_ERROR_FILE", KIND_TEXT, 0, 0, {NULL},
     "where a rank writes its error for the launcher (set by ddpc.launch)"},
    {"DDPC_PARENT_PID", KIND_TEXT, 0, 0, {NULL},
     "the launcher's process id (set by ddpc.launch)"},
    {"DDPC_EXEC_PID", KIND_TEXT, 0, 0, {NULL},
     "the process id of a rank that runs a program (set by ddpc.launch --no-python)"},
    {"DDPC_NO_CUDA", KIND_TEXT, 0, 0, {NULL}, "1: build without CUDA (read by setup.py)"},
    {"DDPC_CUDA_ARCHS", KIND_TEXT, 0, 0, {NULL},
     "the CUDA architectures to build for, as 80;90 (read by setup.py)"},
};

#define NSETTINGS ((int)(sizeof SETTINGS / sizeof SETTINGS[0]))

int ddpc_setting_count(void) { return NSETTINGS; }

const char *ddpc_setting_name(int i) { return i >= 0 && i < NSETTINGS ? SETTINGS[i].name : NULL; }

const char *ddpc_setting_about(int i) {
    return i >= 0 && i < NSETTINGS ? SETTINGS[i].about : NULL;
}

static const Setting *find(const char *name) {
    for (int i = 0; i < NSETTINGS; i++)
        if (!strcmp(SETTINGS[i].name, name)) return &SETTINGS[i];
    return NULL;
}

static ddpc_status unknown(const char *name) {
    return ddpc_error(DDPC_ERR_INVALID, "%s is not a ddpc setting (csrc/settings.c lists them)",
                      name);
}

static ddpc_status wrong_kind(const Setting *s) {
    return ddpc_error(DDPC_ERR_INVALID, "%s is not read as this kind of setting", s->name);
}

/* 1 true yes on / 0 false no off, in any case: 1 or 0; -1 for anything else. */
static int parse_flag(const char *v) {
    static const char *on[] = {"1", "true", "yes", "on"}, *off[] = {"0", "false", "no", "off"};
    for (int i = 0; i < 4; i++) {
        if (!strcasecmp(v, on[i])) return 1;
        if (!strcasecmp(v, off[i])) return 0;
    }
    return -1;
}

/* Decimal digits only (no sign, no spaces), at most 18 of them: 0 on success. */
static int parse_uint(const char *v, double *out) {
    size_t n = strlen(v);
    if (n == 0 || n > 18 || strspn(v, "0123456789") != n) return -1;
    *out = (double)strtoull(v, NULL, 10);
    return 0;
}

static int parse_number(const char *v, double *out) {
    char *end = NULL;
    errno = 0;
    double d = strtod(v, &end);
    if (end == v || *end || errno || !isfinite(d)) return -1;
    *out = d;
    return 0;
}

/* Checks one setting's value (set and not empty); *num gets a number's value, *idx a choice's
 * or a flag's. */
static ddpc_status check_value(const Setting *s, const char *v, double *num, int *idx) {
    switch (s->kind) {
    case KIND_FLAG:
        *idx = parse_flag(v);
        if (*idx >= 0) return DDPC_OK;
        return ddpc_error(DDPC_ERR_INVALID, "%s=%s is not a setting: use 1 or 0 (or true/false, "
                          "yes/no, on/off), or unset it. %s", s->name, v, s->about);
    case KIND_UINT:
        if (parse_uint(v, num) == 0 && *num >= s->lo && *num <= s->hi) return DDPC_OK;
        return ddpc_error(DDPC_ERR_INVALID, "%s=%s is not a setting: use a whole number from %.0f "
                          "to %.0f, or unset it. It is %s", s->name, v, s->lo, s->hi, s->about);
    case KIND_NUMBER:
        if (parse_number(v, num) == 0 && *num >= s->lo && *num <= s->hi) return DDPC_OK;
        return ddpc_error(DDPC_ERR_INVALID, "%s=%s is not a setting: use a number from %g to %g, "
                          "or unset it. It is %s", s->name, v, s->lo, s->hi, s->about);
    case KIND_CHOICE: {
        char list[128] = "";
        for (int i = 0; s->choices[i]; i++) {
            if (!strcasecmp(v, s->choices[i])) {
                *idx = i;
                return DDPC_OK;
            }
            snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? " or " : "",
                     s->choices[i]);
        }
        return ddpc_error(DDPC_ERR_INVALID, "%s=%s is not a setting: use %s, or unset it. %s",
                          s->name, v, list, s->about);
    }
    case KIND_LOGLEVEL:
        *idx = ddpc_log_level_parse(v);
        if (*idx >= 0) return DDPC_OK;
        return ddpc_error(DDPC_ERR_INVALID, "%s=%s is not a setting: use INFO, TRACE or OFF, or "
                          "unset it. %s", s->name, v, s->about);
    default:
        return DDPC_OK;
    }
}

/* The setting's value when it is set to something other than "", else NULL. */
static const char *value_of(const Setting *s) {
    const char *v = getenv(s->name);
    return v && v[0] ? v : NULL;
}

ddpc_status ddpc_setting_check_value(const char *name, const char *value) {
    const Setting *s = find(name);
    if (!s) return unknown(name);
    double num;
    int idx;
    return value && value[0] ? check_value(s, value, &num, &idx) : DDPC_OK;
}

ddpc_status ddpc_settings_check(void) {
    for (int i = 0; i < NSETTINGS; i++)
        DDPC_CHECK(ddpc_setting_check_value(SETTINGS[i].name, getenv(SETTINGS[i].name)));
    return DDPC_OK;
}

ddpc_status ddpc_setting_get(const char *name, DdpcSettingValue *out) {
    memset(out, 0, sizeof *out);
    const Setting *s = find(name);
    if (!s) return unknown(name);
    out->kind = s->kind;
    const char *v = value_of(s);
    if (!v) return DDPC_OK;
    DDPC_CHECK(check_value(s, v, &out->number, &out->index));
    out->set = 1;
    out->text = s->kind == KIND_CHOICE ? s->choices[out->index] : v;
    /* exact: the double only held it for the range check */
    if (s->kind == KIND_UINT) out->whole = strtoull(v, NULL, 10);
    return DDPC_OK;
}

/* ddpc_setting_get for a reader that reads the setting as `kind` (another kind is its bug). */
static ddpc_status get_as(const char *name, int kind, DdpcSettingValue *v) {
    const Setting *s = find(name);
    if (s && s->kind != kind) return wrong_kind(s);
    return ddpc_setting_get(name, v);
}

ddpc_status ddpc_setting_flag(const char *name, int dflt, int *out) {
    DdpcSettingValue v;
    *out = dflt;
    DDPC_CHECK(get_as(name, KIND_FLAG, &v));
    if (v.set) *out = v.index;
    return DDPC_OK;
}

ddpc_status ddpc_setting_uint(const char *name, uint64_t dflt, uint64_t *out) {
    DdpcSettingValue v;
    *out = dflt;
    DDPC_CHECK(get_as(name, KIND_UINT, &v));
    if (v.set) *out = v.whole;
    return DDPC_OK;
}

ddpc_status ddpc_setting_number(const char *name, double dflt, double *out) {
    DdpcSettingValue v;
    *out = dflt;
    DDPC_CHECK(get_as(name, KIND_NUMBER, &v));
    if (v.set) *out = v.number;
    return DDPC_OK;
}

ddpc_status ddpc_setting_choice(const char *name, int *out) {
    DdpcSettingValue v;
    *out = 0;
    DDPC_CHECK(get_as(name, KIND_CHOICE, &v));
    *out = v.index; /* 0, the default, when unset */
    return DDPC_OK;
}

int ddpc_nccl_p2p_off(const char *disable, const char *level, char *why, size_t len) {
    /* As NCCL reads them (src/graph/paths.cc, ncclGetLevel): NCCL_P2P_DISABLE turns P2P off when
     * (int)strtol(value, NULL, 0) == 1 ("true", "yes" or 2 read as other numbers and leave it
     * on); otherwise NCCL_P2P_LEVEL=LOC, or an old-style number that starts with a digit and
     * reads as 0, allows P2P at no distance at all. Other levels allow it up to some distance,
     * which NVLink always is within. */
    const char *by = NULL, *value = NULL;
    if (disable && (int)strtol(disable, NULL, 0) == 1) {
        by = "NCCL_P2P_DISABLE";
        value = disable;
    } else if (level && (!strcmp(level, "LOC") ||
                         (level[0] >= '0' && level[0] <= '9' && strtol(level, NULL, 0) == 0))) {
        by = "NCCL_P2P_LEVEL";
        value = level;
    }
    if (by && why && len) snprintf(why, len, "%s=%s", by, value);
    return by != NULL;
}

int ddpc_nccl_p2p_disabled(char *why, size_t len) {
    /* (NCCL also reads /etc/nccl.conf and ~/.nccl.conf, which ddpc does not.) */
    return ddpc_nccl_p2p_off(getenv("NCCL_P2P_DISABLE"), getenv("NCCL_P2P_LEVEL"), why, len);
}
