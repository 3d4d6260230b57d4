// SPDX-License-Identifier: Apache-2.0
// tandem: the local launcher. `tandem up` runs a whole Tandem stack on one
// machine - the router, N prefill workers and M decode workers as child
// processes - the way an operator would try it on a laptop before taking it to
// a cluster:
//
//   1. the model: --model DIR or a Hugging Face id (common/text/hub), else the
//      built-in demo model, written once with the mkmodel library into
//      $XDG_CACHE_HOME/tandem/models/<preset>-v1 and reused afterwards;
//   2. the ports: the router on --port, decode worker i on port+1+i, prefill
//      worker j after them, each process's nng inbox on its HTTP port + 1000
//      (docs/router-config.md's convention); --port 0 picks free ports;
//   3. a router config (short form: --policy and the workers' addresses) in a
//      private temporary folder, parsed with the router's own parser first;
//   4. the children, each in its own process group (so a terminal's Ctrl-C
//      reaches only the launcher, which then stops them in order) and with
//      PR_SET_PDEATHSIG (so they never outlive a killed launcher); their
//      stdout and stderr come back through one pipe each and are printed line
//      by line behind the child's name (`decode-0 | ...`); they share a
//      control-plane secret drawn for the run (TANDEM_INTERNAL_SECRET, unless
//      the operator set one), so the stack's nng ports refuse other processes;
//   5. readiness: every child's /health polled until 200, with a deadline and
//      an error naming the child that did not make it;
//   6. supervision: a child that dies on its own is started again with the
//      same command line after a backoff (--restart on-failure, the default;
//      the router routes around a missing worker meanwhile); with --restart
//      never its death stops the stack with exit status 1;
//   7. shutdown on SIGINT/SIGTERM: the router first (its open streams still
//      have their workers), then the workers together (each drains its
//      running requests), SIGKILL after --drain-timeout + a grace period; a
//      second signal kills at once. SIGHUP is passed to the router (config reload).
//
// The launcher is single-threaded: one poll() loop over a self-pipe (signals)
// and the children's pipes; health checks are short blocking HTTP requests on
// the loopback between polls.
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "core.h"
#include "hub.h"
#include "mkmodel.h"
#include "openai.h"
#include "transport.h"

#define MAX_WORKERS 64
#define MAX_CHILDREN (2 * MAX_WORKERS + 1)
#define LINE_CAP 8192 // a longer log line is printed in pieces

// Version of the demo model's shapes: bump it when demo_spec changes so an old
// cached folder is not mistaken for the new one.
#define DEMO_MODEL_VERSION "v2" // v2: a chat template that renders tools (hermes)

// ---- options ------------------------------------------------------------------------------

struct up_opts {
    const char *model;       // --model DIR|ID; NULL = the demo model
    const char *revision;    // --revision (Hub ids); NULL = main
    const char *preset;      // --model-preset: demo (default), tiny, qwen2.5-0.5b
    const char *served_name; // --served-model-name; NULL = id, "tandem-demo" or the workers'
    int n_prefill;           // --prefill N (0..MAX_WORKERS)
    int n_decode;            // --decode M (1..MAX_WORKERS)
    int port;                // --port: the router's; workers follow it; 0 = free ports
    const char *host;        // --host: listen address of every process
    int threads_per_worker;  // --threads-per-worker; 0 = online cores / workers
    const char *policy;      // --policy (router short-form policy name)
    const char *pd_mode;     // --pd-mode prefix|always|never
    int pd_threshold;        // --pd-threshold: uncached prompt tokens for remote prefill
    const char *log_level;   // --log-level, passed to every child
    double startup_timeout;  // --startup-timeout: seconds until every /health is 200
    double drain_timeout;    // --drain-timeout: passed to the workers; SIGKILL 15 s later
    int stream_interval;     // --stream-interval, passed to the router and workers
    int max_logprobs;        // --max-logprobs, likewise (-1: not given)
    const char *bin_dir;     // --bin-dir: where the service binaries are
    bool no_router;          // --no-router: workers only (decode workers serve the API)
    bool restart;            // --restart on-failure (default) | never
    bool auto_tool_choice;   // --enable-auto-tool-choice, passed to the router and workers;
                             // on by default where the model's chat template has a parser
    bool no_auto_tools;      // --no-auto-tool-choice: not even by default
    const char *tool_parser; // --tool-call-parser NAME, likewise; NULL = none
    const char *chat_kwargs; // --default-chat-template-kwargs JSON, likewise; NULL = none
    bool tokens_as_ids;      // --return-tokens-as-token-ids, passed to the router and workers
    bool trust_templates;    // --trust-request-chat-template, likewise
    const char *device;      // --device, passed to the workers; NULL = theirs (auto)
    const char *sched;       // --scheduling-policy, passed to the workers; NULL = theirs (fcfs)
    double gpu_util;         // --gpu-memory-utilization per worker; 0 = 0.9 / workers
};

static int set_restart(void *opts, const char *v, char *err, size_t errlen)
{
    if (strcmp(v, "on-failure") && strcmp(v, "never"))
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--restart: expected on-failure or never, got \"%s\"", v);
    ((struct up_opts *)opts)->restart = !strcmp(v, "on-failure");
    return TDM_OK;
}

static int set_pd_mode(void *opts, const char *v, char *err, size_t errlen)
{
    if (strcmp(v, "prefix") && strcmp(v, "always") && strcmp(v, "never"))
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--pd-mode: expected prefix, always or never, got \"%s\"", v);
    ((struct up_opts *)opts)->pd_mode = v;
    return TDM_OK;
}

// --scheduling-policy: the workers' (vLLM's) fcfs or priority, checked here
// so a typo fails before anything starts.
static int set_sched(void *opts, const char *v, char *err, size_t errlen)
{
    if (strcmp(v, "fcfs") != 0 && strcmp(v, "priority") != 0)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--scheduling-policy: unknown policy \"%.64s\" (fcfs or priority)", v);
    ((struct up_opts *)opts)->sched = v;
    return TDM_OK;
}

// --device: what the workers take (their flag checks the module and the GPU
// at startup); here only its form, so a typo fails before anything starts.
static int set_device(void *opts, const char *v, char *err, size_t errlen)
{
    static const char *const names[] = {"cpu", "auto", "cuda", "cuda-emu"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        size_t n = strlen(names[i]);
        if (strncmp(v, names[i], n) != 0)
            continue;
        if (v[n] == '\0') {
            ((struct up_opts *)opts)->device = v;
            return TDM_OK;
        }
        if (v[n] == ':' && i >= 2 && v[n + 1] >= '0' && v[n + 1] <= '9' &&
            strspn(v + n + 1, "0123456789") == strlen(v + n + 1) && strlen(v + n + 1) <= 4) {
            ((struct up_opts *)opts)->device = v;
            return TDM_OK;
        }
    }
    return tdm_seterr(err, errlen, TDM_EINVAL,
                      "--device: expected cpu, auto, cuda, cuda:N or cuda-emu[:N], got \"%s\"", v);
}

// Whether the workers may run on a GPU (cuda, cuda:N, cuda-emu, auto: all
// but cpu), and then share it.
static bool device_may_be_gpu(const struct up_opts *o)
{
    return o->device == NULL || strcmp(o->device, "cpu") != 0;
}

// Each worker's --gpu-memory-utilization: --gpu-memory-utilization, else
// vLLM's default 0.9 split between the workers, which share one GPU (each
// fraction is of the device's total, vLLM's per-instance meaning), rounded
// down to a hundredth.
static double gpu_share(const struct up_opts *o)
{
    if (o->gpu_util > 0)
        return o->gpu_util;
    int workers = o->n_prefill + o->n_decode;
    return (double)(int)(90.0 / (workers > 0 ? workers : 1)) / 100.0;
}

static int set_log_level(void *opts, const char *v, char *err, size_t errlen)
{
    if (strcmp(v, "err") && strcmp(v, "warn") && strcmp(v, "info") && strcmp(v, "debug"))
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--log-level: expected err, warn, info or debug, got \"%s\"", v);
    ((struct up_opts *)opts)->log_level = v;
    return TDM_OK;
}

#define PTR(n, field, mv, h)                                                                       \
    TDM_FLAG_FIELD(struct up_opts, n, TDM_FLAG_PTR, field, .metavar = mv, .help = h,               \
                   .empty_ok = true)
#define NUM(n, k, field, lo, hi, mv, h)                                                            \
    TDM_FLAG_FIELD(struct up_opts, n, k, field, .min = lo, .max = hi, .metavar = mv, .help = h)
#define OFF(field) offsetof(struct up_opts, field)

static const struct tdm_flag up_flags[] = {
    PTR("model", model, "DIR|ID",
        "model folder or Hugging Face id (default: the built-in demo\nmodel, generated on first "
        "use into the cache folder)"),
    PTR("revision", revision, "REV", "branch, tag or commit of a Hugging Face id (default main)"),
    PTR("model-preset", preset, "NAME", "demo model shapes: demo (default), tiny, qwen2.5-0.5b"),
    PTR("served-model-name", served_name, "NAME",
        "the model name clients send (default: the id, tandem-demo,\nor what the workers derive "
        "from the folder)"),
    NUM("prefill", TDM_FLAG_INT, n_prefill, 0, MAX_WORKERS, "N", "prefill workers (default 0)"),
    NUM("decode", TDM_FLAG_INT, n_decode, 1, MAX_WORKERS, "M", "decode workers (default 1)"),
    NUM("port", TDM_FLAG_INT, port, 0, 65535, "P",
        "router port (default 8000); decode i gets P+1+i, prefill j\nP+1+M+j, nng inboxes "
        "HTTP+1000; 0 = free ports"),
    PTR("host", host, "ADDR", "listen address of every process (default 127.0.0.1)"),
    NUM("threads-per-worker", TDM_FLAG_INT, threads_per_worker, 0, 1024, "T",
        "compute threads per worker (default: cores / workers)"),
    PTR("policy", policy, "NAME",
        "round_robin, random, least_loaded (default), prefix_cache,\nsession_affinity"),
    {.name = "pd-mode",
     .kind = TDM_FLAG_FN,
     .fn = set_pd_mode,
     .metavar = "MODE",
     .help = "prefix (default: remote prefill above --pd-threshold uncached\ntokens), always, "
             "never; only with --prefill > 0"},
    NUM("pd-threshold", TDM_FLAG_INT, pd_threshold, 0, 100000000, "N",
        "uncached prompt tokens above which to prefill remotely (256)"),
    {.name = "log-level",
     .kind = TDM_FLAG_FN,
     .fn = set_log_level,
     .metavar = "L",
     .help = "err, warn, info (default), debug - for every process"},
    NUM("startup-timeout", TDM_FLAG_DOUBLE, startup_timeout, 0, 86400, "S",
        "seconds for every /health to turn 200 (default 600)"),
    NUM("drain-timeout", TDM_FLAG_DOUBLE, drain_timeout, 0, 86400, "S",
        "drain on stop, router and workers (default 30); SIGKILL 15 s\nafter"),
    NUM("max-logprobs", TDM_FLAG_INT, max_logprobs, 0, 20, "N",
        "the most logprobs a request may ask, on every process\n(default 20)"),
    NUM("stream-interval", TDM_FLAG_INT, stream_interval, 1, 1 << 20, "N",
        "streams send tokens N per event after the first (default 1),\nrouter and workers"),
    {.name = "enable-auto-tool-choice",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(auto_tool_choice),
     .help = "tool_choice \"auto\" on every process (default: on, with\nthe parser the "
             "model's chat template calls for)"},
    {.name = "no-auto-tool-choice",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(no_auto_tools),
     .help = "tool_choice \"auto\" off (vLLM's default: a 400)"},
    PTR("tool-call-parser", tool_parser, "NAME",
        "hermes or llama3_json (docs/tool-calling.md), for every process"),
    {.name = "default-chat-template-kwargs",
     .kind = TDM_FLAG_PTR,
     .offset = OFF(chat_kwargs),
     .metavar = "JSON",
     .check = tdm_oai_check_chat_template_kwargs,
     .help = "chat template variables under every chat request's\nchat_template_kwargs, on "
             "every process"},
    {.name = "trust-request-chat-template",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(trust_templates),
     .help = "chat requests may bring their own chat_template, on every\nprocess"},
    {.name = "return-tokens-as-token-ids",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(tokens_as_ids),
     .help = "logprobs name tokens \"token_id:<id>\" by default, on every\nprocess"},
    PTR("bin-dir", bin_dir, "DIR",
        "where tandem-router/-prefill/-decode are (default: next to\ntandem, the build tree, "
        "then PATH)"),
    {.name = "restart",
     .kind = TDM_FLAG_FN,
     .fn = set_restart,
     .metavar = "WHEN",
     .help =
         "on-failure (default: a child that dies is started again,\nbackoff 1 s doubling to 30 s; "
         "the others keep serving), never\n(a death stops the stack)"},
    {.name = "no-router",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(no_router),
     .help = "decode workers only, each serving the API on its own port"},
    {.name = "device",
     .kind = TDM_FLAG_FN,
     .fn = set_device,
     .metavar = "D",
     .help = "every worker's --device: cpu, auto, cuda, cuda:N, cuda-emu\n(default: the workers' "
             "own, auto); on a GPU all workers share it"},
    {.name = "scheduling-policy",
     .kind = TDM_FLAG_FN,
     .fn = set_sched,
     .metavar = "P",
     .help = "every worker's --scheduling-policy: fcfs (default) or\npriority (requests' "
             "priority field orders the queue)"},
    NUM("gpu-memory-utilization", TDM_FLAG_DOUBLE, gpu_util, 0.01, 1.0, "F",
        "each worker's share of the GPU's memory (default 0.9 / workers,\nso they fit on one "
        "GPU together)"),
};

static const struct tdm_flags up_table = {
    .usage = "usage: tandem up [options]\n"
             "Runs a Tandem stack on this machine: the router, N prefill and M decode workers.\n",
    .flags = up_flags,
    .n = sizeof up_flags / sizeof up_flags[0],
    .footer = "Ctrl-C (SIGINT) or SIGTERM stops the stack: router first, then the workers drain.\n"
              "SIGHUP makes the router reload its config file (its path is printed at start).\n",
};

static void opts_default(struct up_opts *o)
{
    memset(o, 0, sizeof *o);
    o->preset = "demo";
    o->n_decode = 1;
    o->port = 8000;
    o->host = "127.0.0.1";
    o->policy = "least_loaded";
    o->pd_mode = "prefix";
    o->pd_threshold = 256;
    o->log_level = "info";
    o->startup_timeout = 600;
    o->drain_timeout = 30;
    o->stream_interval = 1;
    o->max_logprobs = -1;
    o->restart = true;
}

// Parses `up`'s arguments (argv[0] is "up"). Returns 0, 1 for --help, -1 after
// printing one line about the bad argument.
static int opts_parse(struct up_opts *o, int argc, char **argv)
{
    char err[512];
    int rc = tdm_flags_parse(&up_table, o, argc, argv, NULL, 0, NULL, err, sizeof err);
    if (rc == 1)
        return 1;
    if (rc != TDM_OK) {
        fprintf(stderr, "tandem up: %s (see tandem up --help)\n", err);
        return -1;
    }
    if (o->model && strcmp(o->preset, "demo")) {
        fprintf(stderr, "tandem up: --model-preset only applies to the demo model (no --model)\n");
        return -1;
    }
    if (o->no_router && o->n_prefill) {
        fprintf(stderr, "tandem up: --no-router runs decode workers only; prefill workers need "
                        "the router (drop --prefill or --no-router)\n");
        return -1;
    }
    if (o->gpu_util > 0 && !device_may_be_gpu(o)) {
        fprintf(stderr, "tandem up: --gpu-memory-utilization does not apply to --device cpu\n");
        return -1;
    }
    if (device_may_be_gpu(o) && gpu_share(o) * (o->n_prefill + o->n_decode) > 1.0 + 1e-9) {
        fprintf(stderr,
                "tandem up: --gpu-memory-utilization %.2f x %d workers is more than the one GPU "
                "they share (at most %.2f each)\n",
                gpu_share(o), o->n_prefill + o->n_decode,
                (double)(int)(100.0 / (o->n_prefill + o->n_decode)) / 100.0);
        return -1;
    }
    if (!*o->host || strlen(o->host) > 200) {
        fprintf(stderr, "tandem up: --host: expected an address\n");
        return -1;
    }
    return 0;
}

// ---- output -------------------------------------------------------------------------------

// snprintf that reports truncation (-1) instead of silently cutting a path.
static int fmt(char *out, size_t cap, const char *f, ...) __attribute__((format(printf, 3, 4)));
static int fmt(char *out, size_t cap, const char *f, ...)
{
    va_list ap;
    va_start(ap, f);
    int n = vsnprintf(out, cap, f, ap);
    va_end(ap);
    return n < 0 || (size_t)n >= cap ? -1 : 0;
}

static int name_width = 6; // the widest prefix ("tandem", "prefill-0", ...)
static bool use_color;

static const char *role_color(const char *name)
{
    if (!use_color)
        return "";
    if (!strncmp(name, "router", 6))
        return "\033[35m";
    if (!strncmp(name, "prefill", 7))
        return "\033[33m";
    if (!strncmp(name, "decode", 6))
        return "\033[36m";
    return "\033[1m";
}

// One line to stdout behind a name; stdout is flushed so lines from the children
// and the launcher keep their order in a pipe too.
static void out_line(const char *name, const char *text, size_t len)
{
    printf("%s%-*s |%s %.*s\n", role_color(name), name_width, name, use_color ? "\033[0m" : "",
           (int)len, text);
    fflush(stdout);
}

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...)
{
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    out_line("tandem", msg, strlen(msg));
}

// ---- children -----------------------------------------------------------------------------

struct argv_buf {
    char args[32][1100];
    char *argv[33];
    int n;
};

enum child_role { CHILD_ROUTER, CHILD_PREFILL, CHILD_DECODE };

struct child {
    enum child_role role;
    char name[24];      // "router", "prefill-0", "decode-3"
    char bin[PATH_MAX]; // executable
    int http_port;
    int nng_port;        // nng inbox (the router's receives the workers' token chunks)
    pid_t pid;           // 0 before start
    int fd;              // read end of its stdout+stderr pipe; -1 after EOF
    char line[LINE_CAP]; // bytes of the current, unfinished log line
    size_t line_len;
    bool healthy;
    bool exited;
    int status;            // waitpid status once exited
    char last_health[96];  // what the last /health check saw, for the startup error
    struct argv_buf *argv; // its command line, kept for restarts (heap)
    int restarts;          // times it was started again after dying
    double started_at;     // tdm_now() of its last start
    double restart_at;     // > 0: dead, to be started again at this tdm_now()
    bool retiring;         // `tandem scale` takes it away: out of the router config, draining
    bool retired;          // stopped by `tandem scale`: never restarted, not in the config
};

static struct child children[MAX_CHILDREN];
static int n_children;

// The control socket `tandem scale` talks to (see "scaling" below): pump
// notes a waiting connection, the serve loop answers it.
static int ctl_listen_fd = -1;
static bool ctl_pending, ctl_busy;

// What cmd_up set up, for workers started later.
static struct {
    const char *model, *served;
    char cfg_path[PATH_MAX];
    int threads;
    char bin[3][PATH_MAX]; // router, prefill, decode ("" = not found yet)
    char run_dir[PATH_MAX];
    char secret_path[PATH_MAX]; // written by us ("" = none, or the operator's file)
    const char *secret_file;    // the file workers must use (ours or the operator's)
    char sock_path[PATH_MAX];   // "" = no control socket
} stk;

// Signals reach the poll loop through this pipe (the handler writes the signal number).
static int sig_pipe[2] = {-1, -1};
static volatile sig_atomic_t stop_signals; // SIGINT/SIGTERM seen so far
static volatile sig_atomic_t hup_pending;  // SIGHUP seen, not yet passed to the router

static void on_signal(int sig)
{
    int saved = errno;
    unsigned char b = (unsigned char)sig;
    if (sig == SIGINT || sig == SIGTERM)
        stop_signals++;
    if (sig == SIGHUP)
        hup_pending = 1;
    if (write(sig_pipe[1], &b, 1) < 0) {
        // The pipe is full: a wake-up is already pending, which is all it is for.
    }
    errno = saved;
}

static int install_signals(void)
{
    if (pipe2(sig_pipe, O_CLOEXEC | O_NONBLOCK) != 0)
        return -1;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    if (sigaction(SIGINT, &sa, NULL) || sigaction(SIGTERM, &sa, NULL) ||
        sigaction(SIGCHLD, &sa, NULL) || sigaction(SIGHUP, &sa, NULL))
        return -1;
    signal(SIGPIPE, SIG_IGN); // a closed stdout reader shows as a failed write, not a death
    return 0;
}

static void describe_status(int status, char *buf, size_t cap)
{
    if (WIFEXITED(status))
        snprintf(buf, cap, "exit status %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status))
        snprintf(buf, cap, "signal %d (%s)", WTERMSIG(status), strsignal(WTERMSIG(status)));
    else
        snprintf(buf, cap, "status 0x%x", status);
}

// Prints the complete lines in c->line (and all of it when flush is set).
static void emit_lines(struct child *c, bool flush)
{
    size_t start = 0;
    for (size_t i = 0; i < c->line_len; i++) {
        if (c->line[i] == '\n') {
            size_t end = i;
            if (end > start && c->line[end - 1] == '\r')
                end--;
            out_line(c->name, c->line + start, end - start);
            start = i + 1;
        }
    }
    if (start < c->line_len && (flush || (start == 0 && c->line_len == sizeof c->line))) {
        out_line(c->name, c->line + start, c->line_len - start);
        start = c->line_len;
    }
    memmove(c->line, c->line + start, c->line_len - start);
    c->line_len -= start;
}

static void read_child(struct child *c)
{
    for (;;) {
        ssize_t n = read(c->fd, c->line + c->line_len, sizeof c->line - c->line_len);
        if (n > 0) {
            c->line_len += (size_t)n;
            emit_lines(c, false);
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        emit_lines(c, true); // EOF (or a read error): the child closed its output
        close(c->fd);
        c->fd = -1;
        return;
    }
}

static void reap_children(void)
{
    for (;;) {
        int status = 0;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid <= 0)
            return;
        for (int i = 0; i < n_children; i++) {
            if (children[i].pid == pid) {
                children[i].exited = true;
                children[i].status = status;
            }
        }
    }
}

// Waits up to timeout seconds for output or a signal, prints what the children
// wrote, and reaps those that exited.
static void pump(double timeout)
{
    struct pollfd pf[MAX_CHILDREN + 2];
    struct child *who[MAX_CHILDREN + 2];
    int n = 0;
    pf[n] = (struct pollfd){.fd = sig_pipe[0], .events = POLLIN};
    who[n++] = NULL;
    int ctl_at = -1; // a `tandem scale` connection waiting: answered by the serve loop
    if (ctl_listen_fd >= 0 && !ctl_busy && !ctl_pending) {
        ctl_at = n;
        pf[n] = (struct pollfd){.fd = ctl_listen_fd, .events = POLLIN};
        who[n++] = NULL;
    }
    for (int i = 0; i < n_children; i++) {
        if (children[i].fd >= 0) {
            pf[n] = (struct pollfd){.fd = children[i].fd, .events = POLLIN};
            who[n++] = &children[i];
        }
    }
    int rc = poll(pf, (nfds_t)n, (int)(timeout * 1000));
    if (rc > 0) {
        for (int i = 0; i < n; i++) {
            if (!(pf[i].revents & (POLLIN | POLLHUP | POLLERR)))
                continue;
            if (who[i]) {
                read_child(who[i]);
            } else if (i == ctl_at) {
                ctl_pending = true;
            } else {
                unsigned char b[64];
                while (read(sig_pipe[0], b, sizeof b) > 0) {
                }
            }
        }
    }
    reap_children();
}

static bool child_running(const struct child *c)
{
    return c->pid > 0 && !c->exited;
}

// Starts c with argv; its stdout and stderr go to a pipe read by the launcher.
static int start_child(struct child *c, char *const argv[])
{
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0) {
        say("%s: pipe: %s", c->name, strerror(errno));
        return -1;
    }
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        say("%s: fork: %s", c->name, strerror(errno));
        close(p[0]);
        close(p[1]);
        return -1;
    }
    if (pid == 0) {
        // Own process group: a terminal's Ctrl-C goes to the launcher only, which
        // stops the children in order. PDEATHSIG: a launcher killed outright still
        // takes its children with it (they drain as on any SIGTERM).
        setpgid(0, 0);
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent)
            _exit(1); // the launcher died before prctl took effect
        int devnull = open("/dev/null", O_RDONLY);
        if (devnull >= 0) {
            dup2(devnull, 0);
            close(devnull);
        }
        dup2(p[1], 1);
        dup2(p[1], 2);
        signal(SIGPIPE, SIG_DFL);
        signal(SIGINT, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
        signal(SIGCHLD, SIG_DFL);
        signal(SIGHUP, SIG_DFL);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        execv(c->bin, argv);
        dprintf(2, "cannot run %s: %s\n", c->bin, strerror(errno));
        _exit(127);
    }
    close(p[1]);
    fcntl(p[0], F_SETFL, fcntl(p[0], F_GETFL) | O_NONBLOCK);
    c->pid = pid;
    c->fd = p[0];
    c->started_at = tdm_now();
    return 0;
}

// ---- HTTP (health checks and /v1/models) -----------------------------------------------

// The address to connect to for a listen address: the loopback for a wildcard.
static const char *connect_host(const char *listen_host)
{
    if (!strcmp(listen_host, "0.0.0.0") || !strcmp(listen_host, "*"))
        return "127.0.0.1";
    if (!strcmp(listen_host, "::") || !strcmp(listen_host, "[::]"))
        return "::1";
    return listen_host;
}

// Connects to host:port within timeout seconds; the socket then has send and
// receive timeouts of the same length. Returns the fd or -1 (why in *why).
static int connect_to(const char *host, int port, double timeout, char *why, size_t whylen)
{
    char h[256], ps[16];
    size_t hl = strlen(host);
    if (host[0] == '[' && hl > 2 && host[hl - 1] == ']')
        snprintf(h, sizeof h, "%.*s", (int)(hl - 2), host + 1);
    else
        snprintf(h, sizeof h, "%s", host);
    snprintf(ps, sizeof ps, "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int gai = getaddrinfo(h, ps, &hints, &res);
    if (gai) {
        fmt(why, whylen, "cannot resolve %s: %s", h, gai_strerror(gai));
        return -1;
    }
    int fd = -1;
    snprintf(why, whylen, "no address");
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0)
            continue;
        int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
        if (rc != 0 && errno == EINPROGRESS) {
            struct pollfd pf = {.fd = fd, .events = POLLOUT};
            int soerr = 0;
            socklen_t sl = sizeof soerr;
            if (poll(&pf, 1, (int)(timeout * 1000)) == 1 &&
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) == 0 && soerr == 0)
                rc = 0;
            else
                errno = soerr ? soerr : ETIMEDOUT;
        }
        if (rc == 0) {
            fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
            struct timeval tv = {.tv_sec = (time_t)timeout,
                                 .tv_usec = (suseconds_t)((timeout - (time_t)timeout) * 1e6)};
            setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
            setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
            break;
        }
        snprintf(why, whylen, "connect: %s", strerror(errno));
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    return fd;
}

// GET path; returns the HTTP status (or -1 with *why set) and, when body is not
// NULL, appends the whole body to it (read to the end of the connection, up to
// 64 MiB: a router's /metrics over many workers is no fixed size).
static int http_get(const char *host, int port, const char *path, double timeout,
                    struct tdm_strbuf *body, char *why, size_t whylen)
{
    int fd = connect_to(host, port, timeout, why, whylen);
    if (fd < 0)
        return -1;
    char req[512];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n",
                     path, host, port);
    if (write(fd, req, (size_t)n) != n) {
        snprintf(why, whylen, "send: %s", strerror(errno));
        close(fd);
        return -1;
    }
    struct tdm_strbuf resp = {.limit = (size_t)64 << 20};
    for (;;) {
        if (tdm_strbuf_reserve(&resp, 64 << 10) != TDM_OK) {
            snprintf(why, whylen, "%s", resp.over ? "answer over 64 MiB" : "out of memory");
            close(fd);
            tdm_strbuf_fini(&resp);
            return -1;
        }
        ssize_t r = read(fd, resp.p + resp.len, resp.cap - 1 - resp.len);
        if (r > 0) {
            resp.len += (size_t)r;
            resp.p[resp.len] = '\0';
            continue;
        }
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && resp.len == 0) {
            snprintf(why, whylen, "read: %s", errno == EAGAIN ? "timed out" : strerror(errno));
            close(fd);
            tdm_strbuf_fini(&resp);
            return -1;
        }
        break;
    }
    close(fd);
    int status = 0;
    if (sscanf(resp.p, "HTTP/1.%*d %d", &status) != 1) {
        snprintf(why, whylen, "not an HTTP answer");
        tdm_strbuf_fini(&resp);
        return -1;
    }
    const char *b = strstr(resp.p, "\r\n\r\n");
    if (body && tdm_strbuf_adds(body, b ? b + 4 : "") != TDM_OK) {
        snprintf(why, whylen, "out of memory");
        tdm_strbuf_fini(&resp);
        return -1;
    }
    tdm_strbuf_fini(&resp);
    snprintf(why, whylen, "HTTP %d", status);
    return status;
}

// ---- ports ------------------------------------------------------------------------------

// Binds host:port (0 = any) to see that it is free; returns the bound port, or
// -1 with errno. With keep, *fd_out keeps the socket open (so the next probe
// gets another free port).
static int probe_port(const char *host, int port, int *fd_out)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV},
                    *res = NULL;
    char ps[16], h[256];
    size_t hl = strlen(host);
    if (host[0] == '[' && hl > 2 && host[hl - 1] == ']')
        snprintf(h, sizeof h, "%.*s", (int)(hl - 2), host + 1);
    else
        snprintf(h, sizeof h, "%s", host);
    snprintf(ps, sizeof ps, "%d", port);
    if (getaddrinfo(h, ps, &hints, &res) != 0) {
        errno = EADDRNOTAVAIL;
        return -1;
    }
    int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int got = -1;
    if (fd >= 0) {
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, res->ai_addr, res->ai_addrlen) == 0) {
            struct sockaddr_storage ss;
            socklen_t sl = sizeof ss;
            if (getsockname(fd, (struct sockaddr *)&ss, &sl) == 0)
                got = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                     : ((struct sockaddr_in *)&ss)->sin_port);
        }
        int saved = errno;
        if (got >= 0 && fd_out)
            *fd_out = fd;
        else
            close(fd);
        errno = saved;
    }
    freeaddrinfo(res);
    return got;
}

// The kernel's ephemeral port range (the source ports of outgoing connections).
static void ephemeral_range(int *lo, int *hi)
{
    *lo = 32768;
    *hi = 60999;
    FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
    if (f) {
        int a, b;
        if (fscanf(f, "%d %d", &a, &b) == 2 && a > 0 && b >= a && b <= 65535) {
            *lo = a;
            *hi = b;
        }
        fclose(f);
    }
}

// A free port for --port 0 in [first, last] (outside the ephemeral range) and
// not one of taken[n] (already handed out): a port the kernel picks for "port 0" can be
// taken by any process's outgoing connection (the services dial each other as
// they start) in the moment between our probe and the child's bind. The probe
// socket stays open in *fd until every port is assigned. -1 with errno when
// none is found.
static int pick_port(const char *host, int first, int last, struct tdm_rng *rng, const int *taken,
                     int n, int *fd)
{
    if (last - first < 100) // no room outside the range: let the kernel choose
        return probe_port(host, 0, fd);
    for (int tries = 0; tries < 1000; tries++) {
        int port = first + (int)(tdm_rng_next(rng) % (uint64_t)(last - first + 1));
        bool dup = false;
        for (int i = 0; i < n && !dup; i++)
            dup = taken[i] == port;
        if (!dup && probe_port(host, port, fd) == port)
            return port;
    }
    errno = EADDRINUSE;
    return -1;
}

// Assigns the HTTP (and nng) ports of children[from..]: fixed ones from
// --port, checked free; or, with --port 0, distinct free ports outside the
// ephemeral range. Children added later (`tandem scale`, from > 0) take the
// next free ports after the highest in use, or free ones with --port 0.
static int assign_ports(const struct up_opts *o, int from)
{
    if (o->port == 0) {
        int held[2 * MAX_CHILDREN], n_held = 0, rc = 0;
        int taken[2 * MAX_CHILDREN], n_taken = 0;
        for (int i = 0; i < from; i++) {
            taken[n_taken++] = children[i].http_port;
            taken[n_taken++] = children[i].nng_port;
        }
        struct tdm_rng rng;
        tdm_rng_seed(&rng, (uint64_t)getpid() ^ (uint64_t)time(NULL) << 20 ^ (uint64_t)clock());
        int lo, hi;
        ephemeral_range(&lo, &hi);
        int first = 10000, last = lo - 1;
        if (last - first < 2000) {
            first = hi + 1;
            last = 65535;
        }
        for (int i = from; i < n_children && !rc; i++) {
            struct child *c = &children[i];
            int *ports[2] = {&c->http_port, &c->nng_port};
            for (int k = 0; k < 2 && !rc; k++) {
                int fd = -1;
                *ports[k] = pick_port(o->host, first, last, &rng, taken, n_taken, &fd);
                if (fd >= 0)
                    held[n_held++] = fd;
                if (*ports[k] < 0) {
                    say("cannot find a free port on %s: %s", o->host, strerror(errno));
                    rc = -1;
                } else {
                    taken[n_taken++] = *ports[k];
                }
            }
        }
        // Released only now, so that no two children got the same port.
        for (int i = 0; i < n_held; i++)
            close(held[i]);
        return rc;
    }
    int next = o->port;
    for (int i = 0; i < from; i++)
        if (children[i].http_port >= next)
            next = children[i].http_port + 1;
    for (int i = from; i < n_children; i++) {
        struct child *c = &children[i];
        // A later worker skips ports another program took meanwhile.
        while (from > 0 && next + 1000 <= 65535 &&
               (probe_port(o->host, next, NULL) < 0 || probe_port(o->host, next + 1000, NULL) < 0))
            next++;
        c->http_port = next++;
        c->nng_port = c->http_port + 1000;
        int ports[2] = {c->http_port, c->nng_port};
        for (int k = 0; k < 2; k++) {
            if (ports[k] > 65535) {
                say("%s: port %d is out of range: choose a lower --port", c->name, ports[k]);
                return -1;
            }
            if (probe_port(o->host, ports[k], NULL) < 0) {
                say("%s: %s port %d on %s is not free (%s): stop what uses it or choose another "
                    "--port (0 = any free ports)",
                    c->name, k ? "nng" : "HTTP", ports[k], o->host, strerror(errno));
                return -1;
            }
        }
    }
    return 0;
}

// ---- binaries ---------------------------------------------------------------------------

static bool executable(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, X_OK) == 0;
}

// Finds a service binary: --bin-dir, the launcher's own folder (install prefix),
// the build tree (build/tools/tandem/tandem -> build/<sub>/<name>), then PATH.
static int find_bin(const struct up_opts *o, const char *name, const char *sub, char *out,
                    size_t cap)
{
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (o->bin_dir) {
        if (!fmt(out, cap, "%s/%s", o->bin_dir, name) && executable(out))
            return 0;
        say("%s not found in --bin-dir %s", name, o->bin_dir);
        return -1;
    }
    if (n > 0) {
        self[n] = '\0';
        char *slash = strrchr(self, '/');
        if (slash)
            *slash = '\0';
        if (!fmt(out, cap, "%s/%s", self, name) && executable(out))
            return 0;
        if (!fmt(out, cap, "%s/../../%s/%s", self, sub, name) && executable(out)) {
            char *r = realpath(out, NULL);
            if (r) {
                snprintf(out, cap, "%s", r);
                free(r);
            }
            return 0;
        }
    }
    const char *path = getenv("PATH");
    while (path && *path) {
        const char *colon = strchr(path, ':');
        size_t len = colon ? (size_t)(colon - path) : strlen(path);
        if (len) {
            if (!fmt(out, cap, "%.*s/%s", (int)len, path, name) && executable(out))
                return 0;
        }
        path = colon ? colon + 1 : NULL;
    }
    say("%s not found next to tandem, in the build tree or on PATH (build it: cmake --build "
        "BUILD --target %s, or give --bin-dir)",
        name, name);
    return -1;
}

// ---- the model ----------------------------------------------------------------------------

static int mkdir_p(const char *path)
{
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s", path);
    for (char *p = tmp + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        if (mkdir(tmp, 0755) != 0 && errno != EEXIST)
            return -1;
        *p = '/';
    }
    return mkdir(tmp, 0755) != 0 && errno != EEXIST ? -1 : 0;
}

// The demo shapes are tandem-mkmodel's "demo" preset (one definition).
static int demo_spec(struct tdm_mkmodel_spec *s, const char *preset)
{
    return tdm_mkmodel_preset(s, preset);
}

static bool model_complete(const char *dir)
{
    static const char *const files[] = {"config.json", "model.safetensors", "tokenizer.json", NULL};
    char p[PATH_MAX];
    struct stat st;
    for (int i = 0; files[i]; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, files[i]);
        if (stat(p, &st) != 0 || !S_ISREG(st.st_mode))
            return false;
    }
    return true;
}

static void remove_tree(const char *dir)
{
    static const char *const files[] = {
        "config.json",           "model.safetensors",      "tokenizer.json",
        "tokenizer_config.json", "generation_config.json", NULL};
    char p[PATH_MAX];
    for (int i = 0; files[i]; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, files[i]);
        unlink(p);
    }
    rmdir(dir);
}

// The demo model's folder: reused when complete, else written into a temporary
// sibling and renamed into place (so an interrupted generation is never reused).
static int demo_model(const struct up_opts *o, char *out, size_t cap)
{
    struct tdm_mkmodel_spec spec;
    char err[512];
    if (demo_spec(&spec, o->preset) != TDM_OK) {
        say("unknown --model-preset \"%s\" (demo, tiny, qwen2.5-0.5b)", o->preset);
        return -1;
    }
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    char base[PATH_MAX];
    if (xdg && *xdg == '/')
        snprintf(base, sizeof base, "%s/tandem/models", xdg);
    else if (home && *home)
        snprintf(base, sizeof base, "%s/.cache/tandem/models", home);
    else {
        say("neither XDG_CACHE_HOME nor HOME is set: give --model DIR");
        return -1;
    }
    int n = snprintf(out, cap, "%s/%s-" DEMO_MODEL_VERSION, base, o->preset);
    if (n < 0 || (size_t)n >= cap) {
        say("cache path too long: %s", base);
        return -1;
    }
    if (model_complete(out))
        return 0;
    if (mkdir_p(base) != 0) {
        say("cannot create %s: %s", base, strerror(errno));
        return -1;
    }
    char tmp[PATH_MAX];
    if (fmt(tmp, sizeof tmp, "%s.tmp-%ld", out, (long)getpid())) {
        say("cache path too long: %s", out);
        return -1;
    }
    say("generating the demo model (preset %s, random weights) into %s", o->preset, out);
    double t0 = tdm_now();
    if (tdm_mkmodel_validate(&spec, err, sizeof err) != TDM_OK ||
        tdm_mkmodel_write(&spec, tmp, err, sizeof err) != TDM_OK) {
        say("writing the demo model: %s", err);
        remove_tree(tmp);
        return -1;
    }
    if (rename(tmp, out) != 0) {
        // Another launcher finished first: use its folder.
        remove_tree(tmp);
        if (!model_complete(out)) {
            say("cannot move the demo model into %s: %s", out, strerror(errno));
            return -1;
        }
    }
    say("demo model ready in %.1f s", tdm_now() - t0);
    return 0;
}

// ---- router config ----------------------------------------------------------------------

// Writes host in the form a URL or YAML needs ([v6] for IPv6 literals).
static void url_host(const char *host, char *out, size_t cap)
{
    if (strchr(host, ':') && host[0] != '[')
        snprintf(out, cap, "[%s]", host);
    else
        snprintf(out, cap, "%s", host);
}

// The short-form router config for this stack (router/config.c writes it, as
// tandem-router --policy does).
static int router_config_text(const struct up_opts *o, char *buf, size_t cap)
{
    struct tdm_router_short_endpoint pre[MAX_WORKERS], dec[MAX_WORKERS];
    size_t np = 0, nd = 0;
    const char *h = connect_host(o->host);
    for (int i = 0; i < n_children; i++) {
        const struct child *c = &children[i];
        if (c->retiring || c->retired)
            continue;
        struct tdm_router_short_endpoint e = {h, c->http_port, c->nng_port};
        if (c->role == CHILD_PREFILL)
            pre[np++] = e;
        else if (c->role == CHILD_DECODE)
            dec[nd++] = e;
    }
    return tdm_router_config_short_text(
               "Written by `tandem up` for this run (tools/tandem/tandem.c).", o->policy,
               o->pd_mode, o->pd_threshold, pre, np, dec, nd, buf, cap) == TDM_OK
               ? 0
               : -1;
}

// Creates a private folder and writes router.yaml into it, after checking the
// text with the router's own parser (so a bad --policy fails here, clearly).
static int write_router_config(const struct up_opts *o, char *dir, size_t dircap, char *path,
                               size_t pathcap)
{
    char text[16384], err[1024];
    if (router_config_text(o, text, sizeof text) != 0) {
        say("router config too long");
        return -1;
    }
    struct tdm_router_config *cfg = NULL;
    if (tdm_router_config_parse(&cfg, text, strlen(text), "router.yaml", err, sizeof err) !=
        TDM_OK) {
        say("router config: %s", err);
        return -1;
    }
    tdm_router_config_unref(cfg);
    const char *tmpdir = getenv("TMPDIR");
    snprintf(dir, dircap, "%s/tandem-up-XXXXXX", tmpdir && *tmpdir ? tmpdir : "/tmp");
    if (!mkdtemp(dir)) {
        say("cannot create a folder for the router config under %s: %s",
            tmpdir && *tmpdir ? tmpdir : "/tmp", strerror(errno));
        dir[0] = '\0';
        return -1;
    }
    snprintf(path, pathcap, "%s/router.yaml", dir);
    FILE *f = fopen(path, "w");
    if (!f || fputs(text, f) == EOF || fclose(f) != 0) {
        say("cannot write %s: %s", path, strerror(errno));
        if (f)
            fclose(f);
        return -1;
    }
    return 0;
}

// ---- the stack ----------------------------------------------------------------------------

// Sends sig to every running child of the given roles.
static void signal_roles(int sig, bool router, bool workers)
{
    for (int i = 0; i < n_children; i++) {
        struct child *c = &children[i];
        bool is_router = c->role == CHILD_ROUTER;
        if (child_running(c) && (is_router ? router : workers))
            kill(c->pid, sig);
    }
}

static bool any_running(bool router, bool workers)
{
    for (int i = 0; i < n_children; i++) {
        bool is_router = children[i].role == CHILD_ROUTER;
        if (child_running(&children[i]) && (is_router ? router : workers))
            return true;
    }
    return false;
}

// Stops one group (router or workers): SIGTERM, pump output until they exit or
// grace seconds pass (or a further signal arrives), then SIGKILL.
static void stop_group(bool router, bool workers, double grace, sig_atomic_t signals_before)
{
    if (!any_running(router, workers))
        return;
    signal_roles(SIGTERM, router, workers);
    double deadline = tdm_now() + grace;
    while (any_running(router, workers) && tdm_now() < deadline && stop_signals <= signals_before)
        pump(0.1);
    if (any_running(router, workers)) {
        if (stop_signals > signals_before)
            say("second signal: killing what is left");
        else
            say("still running %.0f s after SIGTERM: killing what is left", grace);
        signal_roles(SIGKILL, router, workers);
        while (any_running(router, workers))
            pump(0.1);
    }
}

// Stops the whole stack in order; returns true when every child ended cleanly
// (exit 0, or killed by the SIGTERM we sent before it set up its handler).
static bool stop_stack(const struct up_opts *o)
{
    sig_atomic_t before = stop_signals;
    // A signal that started the shutdown counts; the next one escalates.
    stop_group(true, false, o->drain_timeout + 15.0, before); // the router drains too
    stop_group(false, true, o->drain_timeout + 15.0, before);
    // Whatever they wrote last (bounded: a grandchild could hold a pipe open).
    double end = tdm_now() + 2.0;
    for (bool open_fd = true; open_fd && tdm_now() < end;) {
        open_fd = false;
        for (int i = 0; i < n_children; i++)
            open_fd = open_fd || children[i].fd >= 0;
        if (open_fd)
            pump(0.1);
    }
    bool clean = true;
    for (int i = 0; i < n_children; i++) {
        const struct child *c = &children[i];
        if (!c->pid || c->retired)
            continue;
        bool ok = (WIFEXITED(c->status) && WEXITSTATUS(c->status) == 0) ||
                  (WIFSIGNALED(c->status) && WTERMSIG(c->status) == SIGTERM);
        if (!ok) {
            char st[96];
            describe_status(c->status, st, sizeof st);
            say("%s ended with %s", c->name, st);
            clean = false;
        }
    }
    return clean;
}

static void add_child(enum child_role role, int index, const char *bin)
{
    struct child *c = &children[n_children++];
    memset(c, 0, sizeof *c);
    c->role = role;
    c->fd = -1;
    if (role == CHILD_ROUTER)
        snprintf(c->name, sizeof c->name, "router");
    else
        snprintf(c->name, sizeof c->name, "%s-%d", role == CHILD_PREFILL ? "prefill" : "decode",
                 index);
    snprintf(c->bin, sizeof c->bin, "%s", bin);
    snprintf(c->last_health, sizeof c->last_health, "not checked yet");
    if ((int)strlen(c->name) > name_width)
        name_width = (int)strlen(c->name);
}

// Builds a child's argv into storage (strings in args, pointers in argv).

static void arg(struct argv_buf *a, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void arg(struct argv_buf *a, const char *fmt, ...)
{
    if (a->n >= 32)
        return; // never reached: the longest command line has 25 words
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(a->args[a->n], sizeof a->args[a->n], fmt, ap);
    va_end(ap);
    a->argv[a->n] = a->args[a->n];
    a->n++;
    a->argv[a->n] = NULL;
}

// Starts child c with the stack's command line for its role.
static int launch_child(const struct up_opts *o, struct child *c, const char *model,
                        const char *served, const char *router_cfg, int threads)
{
    char nh[300], ch[300];
    url_host(o->host, nh, sizeof nh);
    url_host(connect_host(o->host), ch, sizeof ch);
    if (!c->argv && !(c->argv = calloc(1, sizeof *c->argv))) {
        say("%s: out of memory", c->name);
        return -1;
    }
    struct argv_buf a = {.n = 0};
    arg(&a, "%s", c->bin);
    // The router's inbox gets a port chosen here too: left to the kernel it
    // could take a worker's port in the moment between our probe and its bind.
    if (c->role == CHILD_ROUTER)
        arg(&a, "--config"), arg(&a, "%s", router_cfg), arg(&a, "--nng-url"),
            arg(&a, "tcp://%s:%d", ch, c->nng_port);
    arg(&a, "--model"), arg(&a, "%s", model);
    arg(&a, "--host"), arg(&a, "%s", o->host);
    arg(&a, "--port"), arg(&a, "%d", c->http_port);
    if (served)
        arg(&a, "--served-model-name"), arg(&a, "%s", served);
    arg(&a, "--log-level"), arg(&a, "%s", o->log_level);
    arg(&a, "--drain-timeout"), arg(&a, "%g", o->drain_timeout);
    if (o->stream_interval > 1)
        arg(&a, "--stream-interval"), arg(&a, "%d", o->stream_interval);
    if (o->max_logprobs >= 0)
        arg(&a, "--max-logprobs"), arg(&a, "%d", o->max_logprobs);
    if (o->auto_tool_choice)
        arg(&a, "--enable-auto-tool-choice");
    if (o->tool_parser && *o->tool_parser)
        arg(&a, "--tool-call-parser"), arg(&a, "%s", o->tool_parser);
    if (o->tokens_as_ids)
        arg(&a, "--return-tokens-as-token-ids");
    if (o->trust_templates)
        arg(&a, "--trust-request-chat-template");
    if (o->chat_kwargs)
        arg(&a, "--default-chat-template-kwargs"), arg(&a, "%s", o->chat_kwargs);
    if (c->role != CHILD_ROUTER) {
        arg(&a, "--threads"), arg(&a, "%d", threads);
        if (o->device)
            arg(&a, "--device"), arg(&a, "%s", o->device);
        if (o->sched)
            arg(&a, "--scheduling-policy"), arg(&a, "%s", o->sched);
        if (device_may_be_gpu(o))
            arg(&a, "--gpu-memory-utilization"), arg(&a, "%.2f", gpu_share(o));
        if (!o->no_router)
            arg(&a, "--nng-url"), arg(&a, "tcp://%s:%d", nh, c->nng_port);
    }
    *c->argv = a;
    for (int k = 0; k < a.n; k++) // the copy's argv points into the copy
        c->argv->argv[k] = c->argv->args[k];
    if (start_child(c, c->argv->argv) != 0)
        return -1;
    return 0;
}

static int launch_all(const struct up_opts *o, const char *model, const char *served,
                      const char *router_cfg, int threads)
{
    for (int i = 0; i < n_children; i++)
        if (launch_child(o, &children[i], model, served, router_cfg, threads) != 0)
            return -1;
    return 0;
}

// Supervision (--restart on-failure): a child that died is started again with
// the same command line after a backoff (1 s, doubling to 30 s, back to 1 s
// once it has run for a minute), as a process supervisor or the kubelet would;
// the router routes around a missing worker meanwhile. Returns false when
// restarting is off and the stack must stop.
static bool supervise(const struct up_opts *o)
{
    double now = tdm_now();
    for (int i = 0; i < n_children; i++) {
        struct child *c = &children[i];
        if (c->retiring || c->retired)
            continue; // `tandem scale` stops these itself
        if (c->exited && c->restart_at == 0) {
            char st[96];
            describe_status(c->status, st, sizeof st);
            if (!o->restart) {
                say("%s exited unexpectedly (%s): stopping the stack", c->name, st);
                return false;
            }
            double backoff = 1.0;
            if (now - c->started_at < 60.0)
                for (int k = 0; k < c->restarts && backoff < 30.0; k++)
                    backoff *= 2;
            else
                c->restarts = 0;
            if (backoff > 30.0)
                backoff = 30.0;
            c->restart_at = now + backoff;
            say("%s exited unexpectedly (%s): restarting it in %.0f s", c->name, st, backoff);
        }
        if (c->exited && c->restart_at > 0 && now >= c->restart_at) {
            if (c->fd >= 0) {
                close(c->fd);
                c->fd = -1;
            }
            c->line_len = 0;
            c->exited = false;
            c->healthy = false;
            c->restart_at = 0;
            c->restarts++;
            c->started_at = now;
            if (start_child(c, c->argv->argv) == 0)
                say("%s restarted (restart %d, pid %ld)", c->name, c->restarts, (long)c->pid);
            else
                c->restart_at = now + 5.0; // fork failed: try again later
        }
    }
    return true;
}

// The router's /health turns 200 with the first healthy decode worker; the stack
// is ready when the router counts every worker as ready (its
// tandem:router_ready_endpoints gauge), so the first request can already be
// disaggregated. Returns true when the counts match, or when the router does
// not export the gauge (nothing more to wait for then).
// metrics_sees_all reads a /metrics page already fetched; router_sees_all
// fetches one.
static bool metrics_sees_all(const char *body, int n_prefill, int n_decode, char *why,
                             size_t whylen)
{
    static const char *const roles[2] = {"prefill", "decode"};
    int want[2] = {n_prefill, n_decode};
    for (int r = 0; r < 2; r++) {
        char key[96];
        snprintf(key, sizeof key, "tandem:router_ready_endpoints{role=\"%s\"} ", roles[r]);
        const char *at = strstr(body, key);
        if (!at)
            return true;
        int have = atoi(at + strlen(key));
        if (have < want[r]) {
            snprintf(why, whylen, "router counts %d of %d %s workers ready", have, want[r],
                     roles[r]);
            return false;
        }
    }
    return true;
}

static bool router_sees_all(const char *host, const struct child *router, int n_prefill,
                            int n_decode, char *why, size_t whylen)
{
    struct tdm_strbuf body = {0};
    bool all = http_get(host, router->http_port, "/metrics", 1.0, &body, why, whylen) == 200 &&
               metrics_sees_all(body.p, n_prefill, n_decode, why, whylen);
    tdm_strbuf_fini(&body);
    return all;
}

// One readiness probe of c: /health 200; for a worker behind the router also
// its nng inbox accepting connections (a decode worker answers /health as soon
// as the model is loaded, a moment before its P/D inbox listens, and a router
// request in that moment would count against it); for the router, every worker
// counted ready. Leaves what it saw in c->last_health.
static bool check_child(const struct up_opts *o, const char *h, struct child *c)
{
    int st = http_get(h, c->http_port, "/health", 1.0, NULL, c->last_health, sizeof c->last_health);
    if (st != 200)
        return false;
    if (c->role == CHILD_ROUTER)
        return router_sees_all(h, c, o->n_prefill, o->n_decode, c->last_health,
                               sizeof c->last_health);
    if (o->no_router)
        return true;
    char why[96];
    int fd = connect_to(h, c->nng_port, 1.0, why, sizeof why);
    if (fd < 0) {
        fmt(c->last_health, sizeof c->last_health, "200, but nng port %d: %s", c->nng_port, why);
        return false;
    }
    close(fd);
    return true;
}

// Polls every unhealthy child's /health until all answer 200. Returns 0 when
// ready, 1 when a stop signal came first, -1 on a failure (already reported).
static int wait_ready(const struct up_opts *o)
{
    const char *h = connect_host(o->host);
    double deadline = tdm_now() + o->startup_timeout, next_check = 0;
    for (;;) {
        pump(0.1);
        if (stop_signals)
            return 1;
        for (int i = 0; i < n_children; i++) {
            struct child *c = &children[i];
            if (c->exited) {
                char st[96];
                describe_status(c->status, st, sizeof st);
                say("%s exited (%s) before it became healthy; see its log above", c->name, st);
                return -1;
            }
        }
        if (tdm_now() < next_check)
            continue;
        next_check = tdm_now() + 0.25;
        // Workers first; the router only once every worker is up, so that what it
        // reports is about workers that can already take requests.
        bool all = true;
        for (int pass = 0; pass < 2; pass++) {
            for (int i = 0; i < n_children; i++) {
                struct child *c = &children[i];
                if (c->healthy || (c->role == CHILD_ROUTER) != (pass == 1))
                    continue;
                if (pass == 1 && !all)
                    break;
                if (check_child(o, h, c)) {
                    c->healthy = true;
                    say("%s healthy on port %d", c->name, c->http_port);
                } else {
                    all = false;
                }
            }
        }
        if (all)
            return 0;
        if (tdm_now() > deadline) {
            for (int i = 0; i < n_children; i++)
                if (!children[i].healthy)
                    say("%s (port %d) did not become healthy within %.0f s (last /health: %s)",
                        children[i].name, children[i].http_port, o->startup_timeout,
                        children[i].last_health);
            return -1;
        }
    }
}

// The served model name as the API reports it (for the curl line).
static void served_name_from_api(const char *host, int port, char *out, size_t cap)
{
    struct tdm_strbuf body = {0};
    char why[128];
    const char *id = NULL;
    if (http_get(host, port, "/v1/models", 5.0, &body, why, sizeof why) == 200)
        id = strstr(body.p, "\"id\"");
    if (id && (id = strchr(id + 4, '"')) != NULL) {
        const char *end = strchr(id + 1, '"');
        if (end && (size_t)(end - id - 1) < cap)
            snprintf(out, cap, "%.*s", (int)(end - id - 1), id + 1);
    }
    tdm_strbuf_fini(&body);
}

static void print_ready(const struct up_opts *o, const char *model, const char *served,
                        const char *router_cfg, double t0)
{
    const char *h = connect_host(o->host);
    char uh[300];
    url_host(h, uh, sizeof uh);
    const struct child *api = &children[0]; // the router, or decode-0 with --no-router
    char name[256];
    snprintf(name, sizeof name, "%s", served ? served : "");
    if (!served)
        served_name_from_api(h, api->http_port, name, sizeof name);
    say("ready in %.1f s: %s%d prefill + %d decode workers, model %s (%s)", tdm_now() - t0,
        o->no_router ? "no router, " : "", o->n_prefill, o->n_decode, name[0] ? name : "?", model);
    for (int i = 0; i < n_children; i++) {
        const struct child *c = &children[i];
        if (c->role == CHILD_ROUTER)
            say("  %-*s http://%s:%d  OpenAI API, policy %s  pid %ld", name_width, c->name, uh,
                c->http_port, o->policy, (long)c->pid);
        else if (o->no_router)
            say("  %-*s http://%s:%d  OpenAI API  pid %ld", name_width, c->name, uh, c->http_port,
                (long)c->pid);
        else
            say("  %-*s http://%s:%d  nng tcp://%s:%d  pid %ld", name_width, c->name, uh,
                c->http_port, uh, c->nng_port, (long)c->pid);
    }
    if (router_cfg[0])
        say("router config: %s", router_cfg);
    if (stk.secret_file)
        say("control-plane secret: %s (only you can read it); a worker you start by hand "
            "needs TANDEM_INTERNAL_SECRET_FILE=%s",
            stk.secret_file, stk.secret_file);
    if (ctl_listen_fd >= 0)
        say("more or fewer workers: tandem scale --port %d --decode N%s (control socket %s)",
            api->http_port, o->no_router ? "" : " --prefill N", stk.sock_path);
    bool pd = !o->no_router && o->n_prefill > 0 && strcmp(o->pd_mode, "never") != 0;
    bool short_pd = pd && !strcmp(o->pd_mode, "always");
    say("try it (Ctrl-C stops the stack); %s:",
        short_pd ? "disaggregated: prefill-0 computes the prompt, a decode worker streams"
                 : "a short prompt, served by a decode worker alone");
    printf("curl -s http://%s:%d/v1/completions -H 'Content-Type: application/json' -d "
           "'{\"model\": \"%s\", \"prompt\": \"Serving a language model is\", \"max_tokens\": "
           "32}'\n",
           uh, api->http_port, name[0] ? name : "MODEL");
    if (pd && !short_pd) {
        // A prompt over the P/D threshold (about 420 tokens of this text), so
        // the prefill worker computes its KV and the decode worker streams.
        say("disaggregated: a prompt over --pd-threshold %d tokens, prefilled by a prefill "
            "worker, streamed by a decode worker:",
            o->pd_threshold);
        printf("curl -s http://%s:%d/v1/completions -H 'Content-Type: application/json' -d "
               "\"{\\\"model\\\": \\\"%s\\\", \\\"max_tokens\\\": 32, \\\"prompt\\\": \\\"$(yes "
               "'Serving a language model is hard.' | head -%d | tr '\\n' ' ')\\\"}\"\n",
               uh, api->http_port, name[0] ? name : "MODEL", o->pd_threshold / 7 * 2 + 20);
    }
    fflush(stdout);
}

// ---- scaling: the control socket and `tandem scale` ---------------------------------------
// A running `tandem up` listens on a Unix socket in a folder only its user can
// open (XDG_RUNTIME_DIR/tandem, else /tmp/tandem-UID, mode 0700, checked to be
// the user's own), named after the API port: up-PORT.sock. Beside it,
// up-PORT.secret (0600) holds the stack's control-plane secret, so that a
// worker started by hand can join (TANDEM_INTERNAL_SECRET_FILE). One request
// per connection, one line: "scale P D" (-1 = leave that role as it is) or
// "status"; the answer is progress lines, then "ok ..." or "error ...".
// Peers are checked with SO_PEERCRED as well: only this user's processes.

// The per-user folder for sockets and secrets: created 0700 if missing; an
// existing one must be a folder owned by this user that nobody else can open.
static int run_dir(char *out, size_t cap, char *why, size_t whylen)
{
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    int n = xdg && *xdg == '/' ? snprintf(out, cap, "%s/tandem", xdg)
                               : snprintf(out, cap, "/tmp/tandem-%ld", (long)getuid());
    if (n < 0 || (size_t)n >= cap) {
        snprintf(why, whylen, "the run folder's path is too long");
        return -1;
    }
    if (mkdir(out, 0700) != 0 && errno != EEXIST) {
        fmt(why, whylen, "cannot create %s: %s", out, strerror(errno));
        return -1;
    }
    struct stat st;
    if (lstat(out, &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != getuid() ||
        (st.st_mode & 077) != 0) {
        fmt(why, whylen, "%s is not a folder only you can open (remove it, or set XDG_RUNTIME_DIR)",
            out);
        return -1;
    }
    return 0;
}

static void sock_path_for(const char *dir, int port, char *out, size_t cap)
{
    if (fmt(out, cap, "%s/up-%d.sock", dir, port) != 0)
        out[0] = '\0';
}

// Writes the secret into a new 0600 file (never through a link).
static int write_secret(const char *path, const char *secret)
{
    unlink(path);
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
        return -1;
    size_t len = strlen(secret);
    bool ok = write(fd, secret, len) == (ssize_t)len && write(fd, "\n", 1) == 1;
    ok = close(fd) == 0 && ok;
    if (!ok)
        unlink(path);
    return ok ? 0 : -1;
}

// The secret file and the control socket for the stack whose API is on port.
// Failures only lose the convenience (said once); the stack runs anyway.
static void control_open(int port)
{
    char why[PATH_MAX + 128];
    if (run_dir(stk.run_dir, sizeof stk.run_dir, why, sizeof why) != 0) {
        say("no control socket (`tandem scale` will not find this stack): %s", why);
        return;
    }
    const char *given = getenv("TANDEM_INTERNAL_SECRET_FILE");
    if (given && *given) {
        stk.secret_file = given;
    } else if (fmt(stk.secret_path, sizeof stk.secret_path, "%s/up-%d.secret", stk.run_dir, port) ==
                   0 &&
               write_secret(stk.secret_path, getenv("TANDEM_INTERNAL_SECRET")) == 0) {
        stk.secret_file = stk.secret_path;
    } else {
        say("cannot write the secret file %s: %s", stk.secret_path, strerror(errno));
        stk.secret_path[0] = '\0';
    }
    sock_path_for(stk.run_dir, port, stk.sock_path, sizeof stk.sock_path);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (!stk.sock_path[0] || strlen(stk.sock_path) >= sizeof sa.sun_path) {
        say("no control socket: the path under %s is too long for a Unix socket", stk.run_dir);
        stk.sock_path[0] = '\0';
        return;
    }
    memcpy(sa.sun_path, stk.sock_path, strlen(stk.sock_path) + 1); // length checked above
    unlink(stk.sock_path); // a stale one: its ports were free, so its stack is gone
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    mode_t old = umask(0177);
    int rc = fd < 0 ? -1 : bind(fd, (struct sockaddr *)&sa, sizeof sa);
    umask(old);
    if (rc != 0 || listen(fd, 4) != 0) {
        say("no control socket %s: %s", stk.sock_path, strerror(errno));
        if (fd >= 0)
            close(fd);
        stk.sock_path[0] = '\0';
        return;
    }
    ctl_listen_fd = fd;
}

static void control_close(void)
{
    if (ctl_listen_fd >= 0)
        close(ctl_listen_fd);
    ctl_listen_fd = -1;
    if (stk.sock_path[0])
        unlink(stk.sock_path);
    if (stk.secret_path[0])
        unlink(stk.secret_path);
}

// A line to the `tandem scale` client (bounded by its send timeout; a client
// that went away only loses the text) and to the launcher's own output.
static void tell(int fd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void tell(int fd, const char *f, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, f);
    vsnprintf(msg, sizeof msg, f, ap);
    va_end(ap);
    say("scale: %s", msg);
    if (fd >= 0) {
        size_t len = strlen(msg);
        msg[len] = '\n';
        if (send(fd, msg, len + 1, MSG_NOSIGNAL) < 0) {
            // The client left: the scaling goes on regardless.
        }
    }
}

static int active_count(enum child_role role)
{
    int n = 0;
    for (int i = 0; i < n_children; i++)
        n += children[i].role == role && !children[i].retiring && !children[i].retired;
    return n;
}

static int next_index(enum child_role role)
{
    int n = 0;
    for (int i = 0; i < n_children; i++)
        n += children[i].role == role;
    return n;
}

// The router's count of successful config reloads in a /metrics page (-1:
// not known).
static long metrics_reloads(const char *body)
{
    const char *key = "tandem:router_config_reload_total{result=\"success\"} ";
    const char *at = strstr(body, key);
    return at ? atol(at + strlen(key)) : -1;
}

// One look at the router's /metrics, for router_follow: true when it counts a
// reload after before (before < 0: any) and every worker ready. Else false,
// with why set as router_sees_all sets it once the reload is counted (left
// as it was while it is not).
static bool router_took_config(const struct up_opts *o, const char *host, long before, char *why,
                               size_t whylen)
{
    struct tdm_strbuf body = {0};
    char fetch_why[160];
    int st =
        http_get(host, children[0].http_port, "/metrics", 2.0, &body, fetch_why, sizeof fetch_why);
    long now = st == 200 ? metrics_reloads(body.p) : -1;
    bool took = false;
    if (before < 0 || now > before) { // else not counted yet: why stays as it was
        if (st != 200)
            snprintf(why, whylen, "%s", fetch_why);
        else
            took = metrics_sees_all(body.p, o->n_prefill, o->n_decode, why, whylen);
    }
    tdm_strbuf_fini(&body);
    return took;
}

// How long router_follow tries to read the router's reload count before it
// changes the config (each read waits up to 2 s for an answer).
#define ROUTER_FIRST_READ_S 6.0

// The router's count of successful config reloads: >= 0; -1 where its
// /metrics answers without one; -2 where it does not answer 200 (why says
// how it failed).
static long router_reloads(const char *host, char *why, size_t whylen)
{
    struct tdm_strbuf body = {0};
    int st = http_get(host, children[0].http_port, "/metrics", 2.0, &body, why, whylen);
    long n = st == 200 ? metrics_reloads(body.p) : -2;
    tdm_strbuf_fini(&body);
    return n;
}

// Waits (pumping the children's output) until every child in new[0..n) is
// healthy. 0, or -1 with the reason told to the client.
static int wait_new_healthy(const struct up_opts *o, struct child **nw, int n, int cfd)
{
    const char *h = connect_host(o->host);
    double deadline = tdm_now() + o->startup_timeout;
    for (int left = n; left > 0;) {
        pump(0.25);
        if (stop_signals) {
            tell(cfd, "error: the stack is stopping");
            return -1;
        }
        left = 0;
        for (int i = 0; i < n; i++) {
            struct child *c = nw[i];
            if (c->healthy)
                continue;
            if (c->exited) {
                char st[96];
                describe_status(c->status, st, sizeof st);
                tell(cfd, "error: %s exited (%s) before it became healthy; see its log", c->name,
                     st);
                return -1;
            }
            if (check_child(o, h, c)) {
                c->healthy = true;
                tell(cfd, "%s healthy on port %d", c->name, c->http_port);
            } else {
                left++;
            }
        }
        if (left && tdm_now() > deadline) {
            tell(cfd, "error: new workers not healthy within --startup-timeout %.0f s",
                 o->startup_timeout);
            return -1;
        }
    }
    return 0;
}

// Stops the children in list[0..n) (SIGTERM: each drains; SIGKILL after
// --drain-timeout + 15 s) and marks them retired.
static void retire(const struct up_opts *o, struct child **list, int n)
{
    for (int i = 0; i < n; i++) {
        list[i]->retiring = true;
        if (child_running(list[i]))
            kill(list[i]->pid, SIGTERM);
    }
    double deadline = tdm_now() + o->drain_timeout + 15.0;
    for (bool any = true; any;) {
        any = false;
        for (int i = 0; i < n; i++)
            any = any || child_running(list[i]);
        if (!any)
            break;
        if (tdm_now() > deadline) {
            for (int i = 0; i < n; i++)
                if (child_running(list[i]))
                    kill(list[i]->pid, SIGKILL);
        }
        pump(0.1);
    }
    for (int i = 0; i < n; i++) {
        list[i]->retired = true;
        list[i]->healthy = false;
    }
}

// Whether the file at path holds exactly text.
static bool file_holds(const char *path, const char *text)
{
    char *bytes, err[256];
    size_t len;
    if (tdm_read_file(path, &bytes, &len, err, sizeof err) != TDM_OK)
        return false;
    bool same = len == strlen(text) && memcmp(bytes, text, len) == 0;
    free(bytes);
    return same;
}

// The router's config rewritten for the children now active (atomically: a
// reload never reads half a file), then SIGHUP; waits until the router has
// reloaded and counts the new workers ready. The router also reloads a changed
// file by itself (its watcher, within a 100 ms debounce), and a reload of the
// bytes already active counts nothing; so the count to exceed is read before
// the file changes: read after, it may include the watcher's reload, and the
// SIGHUP's would then never be counted (a 60 s wait and "no reload counted").
// That first read is retried for ROUTER_FIRST_READ_S; a router whose /metrics
// never answers still gets the new config and the SIGHUP (it takes them once
// it answers again: the file then matches the workers this launcher runs),
// but the scaling fails, as nothing can tell its reload from the state before.
// A config whose bytes are already the file's (a scaling to the counts that
// run) is neither written nor signalled, as no reload of it would be counted:
// the router is only checked to see every worker ready.
// Returns 0, ROUTER_UNCHANGED where the file could not be written (the
// router's config is still the one before: nothing changed for it), or -1
// where the reload was not confirmed (the file is written, the router may
// take it later).
#define ROUTER_UNCHANGED (-2)
static int router_follow(const struct up_opts *o, int cfd)
{
    if (o->no_router)
        return 0;
    char text[16384], tmp[PATH_MAX + 8];
    if (router_config_text(o, text, sizeof text) != 0 ||
        fmt(tmp, sizeof tmp, "%s.new", stk.cfg_path) != 0) {
        tell(cfd, "error: router config too long");
        return ROUTER_UNCHANGED;
    }
    const char *h = connect_host(o->host);
    char why[160] = "";
    bool same = file_holds(stk.cfg_path, text);
    long before = -1; // a router not running reads the new file as it starts
    double until = tdm_now() + ROUTER_FIRST_READ_S;
    while (child_running(&children[0]) && (before = router_reloads(h, why, sizeof why)) == -2 &&
           !stop_signals && tdm_now() < until)
        pump(0.2);
    bool unanswered = before == -2 && child_running(&children[0]);
    if (!same) {
        FILE *f = fopen(tmp, "w");
        bool ok = f && fputs(text, f) != EOF;
        ok = f && fclose(f) == 0 && ok;
        if (!ok || rename(tmp, stk.cfg_path) != 0) {
            tell(cfd, "error: cannot write %s: %s", stk.cfg_path, strerror(errno));
            unlink(tmp);
            return ROUTER_UNCHANGED;
        }
    }
    if (!child_running(&children[0])) {
        tell(cfd, "the router is restarting: it reads the new config as it starts");
        return 0;
    }
    if (!same)
        kill(children[0].pid, SIGHUP);
    if (unanswered) {
        tell(cfd,
             "error: the router's /metrics (http://%s:%d/metrics) did not answer within %.0f s "
             "(%s): %s %s, but the router's state cannot be confirmed",
             h, children[0].http_port, ROUTER_FIRST_READ_S, why[0] ? why : "no answer",
             stk.cfg_path, same ? "is unchanged" : "is written and the router signalled");
        return -1;
    }
    why[0] = '\0';
    double deadline = tdm_now() + 60.0;
    for (;;) {
        pump(0.2);
        if (router_took_config(o, h, same ? -1 : before, why, sizeof why))
            break;
        if (stop_signals || tdm_now() > deadline) {
            tell(cfd, "error: the router did not take the new config (%s)",
                 why[0] ? why : "no reload counted");
            return -1;
        }
    }
    tell(cfd, "router %s %s: %d prefill + %d decode workers", same ? "already has" : "reloaded",
         stk.cfg_path, o->n_prefill, o->n_decode);
    return 0;
}

// Scales the running stack to want_p prefill and want_d decode workers (-1:
// as they are): new workers are started and awaited, then the router takes
// the new config; workers taken away leave the router's config first (no new
// requests), then drain and stop. The highest-numbered ones go first.
static void scale(struct up_opts *o, int want_p, int want_d, int cfd)
{
    int have_p = active_count(CHILD_PREFILL), have_d = active_count(CHILD_DECODE);
    if (want_p < 0)
        want_p = have_p;
    if (want_d < 0)
        want_d = have_d;
    if (want_d < 1 || want_d > MAX_WORKERS || want_p > MAX_WORKERS) {
        tell(cfd, "error: --decode must be 1 to %d and --prefill 0 to %d", MAX_WORKERS,
             MAX_WORKERS);
        return;
    }
    if (o->no_router && want_p > 0) {
        tell(cfd, "error: this stack runs without a router (--no-router): prefill workers need "
                  "one");
        return;
    }
    int add_p = want_p > have_p ? want_p - have_p : 0,
        add_d = want_d > have_d ? want_d - have_d : 0;
    if (n_children + add_p + add_d > MAX_CHILDREN) {
        tell(cfd,
             "error: this launcher has started %d processes, its limit is %d: restart the "
             "stack to go further",
             n_children, MAX_CHILDREN);
        return;
    }
    if (add_p && !stk.bin[1][0] &&
        find_bin(o, "tandem-prefill", "prefill", stk.bin[1], sizeof stk.bin[1]) != 0) {
        stk.bin[1][0] = '\0';
        tell(cfd, "error: tandem-prefill not found (see the launcher's log)");
        return;
    }
    // Workers started later get the share the first ones got; on a GPU named
    // outright, more than it has together is refused (with --device auto a
    // worker that finds no room fails its startup, which is reported).
    if (o->device && !strncmp(o->device, "cuda", 4) &&
        gpu_share(o) * (want_p + want_d) > 1.0 + 1e-9) {
        tell(cfd,
             "error: %d workers x --gpu-memory-utilization %.2f is more than the one GPU "
             "they share: start the stack with a smaller --gpu-memory-utilization",
             want_p + want_d, gpu_share(o));
        return;
    }
    tell(cfd, "scaling from %d prefill + %d decode to %d prefill + %d decode workers", have_p,
         have_d, want_p, want_d);
    // Up: start and await the new ones.
    int first = n_children;
    struct child *nw[2 * MAX_WORKERS];
    int n_new = 0;
    for (int i = 0; i < add_d; i++)
        add_child(CHILD_DECODE, next_index(CHILD_DECODE), stk.bin[2]);
    for (int i = 0; i < add_p; i++)
        add_child(CHILD_PREFILL, next_index(CHILD_PREFILL), stk.bin[1]);
    if (n_children > first && assign_ports(o, first) != 0) {
        n_children = first;
        tell(cfd, "error: no free ports for the new workers (see the launcher's log)");
        return;
    }
    for (int i = first; i < n_children; i++) {
        nw[n_new++] = &children[i];
        if (launch_child(o, &children[i], stk.model, stk.served, stk.cfg_path, stk.threads) != 0) {
            retire(o, nw, n_new);
            tell(cfd, "error: cannot start %s", children[i].name);
            return;
        }
        tell(cfd, "%s started: http://%s:%d, nng port %d, pid %ld", children[i].name,
             connect_host(o->host), children[i].http_port, children[i].nng_port,
             (long)children[i].pid);
    }
    if (n_new && wait_new_healthy(o, nw, n_new, cfd) != 0) {
        retire(o, nw, n_new);
        return;
    }
    // Down: the highest-numbered workers of each role leave the config.
    struct child *gone[2 * MAX_WORKERS];
    int n_gone = 0;
    int drop[2] = {have_p - want_p, have_d - want_d};
    enum child_role roles[2] = {CHILD_PREFILL, CHILD_DECODE};
    for (int r = 0; r < 2; r++)
        for (int i = n_children - 1; i >= 0 && drop[r] > 0; i--) {
            struct child *c = &children[i];
            if (c->role == roles[r] && !c->retiring && !c->retired) {
                c->retiring = true;
                gone[n_gone++] = c;
                drop[r]--;
            }
        }
    o->n_prefill = want_p;
    o->n_decode = want_d;
    int rc = router_follow(o, cfd);
    if (rc == ROUTER_UNCHANGED) {
        // The router still routes by the config before: the workers taken
        // away stay (they may hold its streams), and the new ones, which it
        // was never told of, stop. Nothing changed.
        for (int i = 0; i < n_gone; i++)
            gone[i]->retiring = false;
        o->n_prefill = have_p;
        o->n_decode = have_d;
        if (n_new) {
            retire(o, nw, n_new);
            for (int i = 0; i < n_new; i++)
                tell(cfd, "%s stopped: the router was not told of it", nw[i]->name);
        }
        tell(cfd, "error: nothing changed: %d prefill + %d decode workers, as before", have_p,
             have_d);
        return;
    }
    // Written: the router takes the file now or, where that was not
    // confirmed (rc -1, said above), once it answers again; the workers
    // taken away are out of it either way.
    if (n_gone) {
        for (int i = 0; i < n_gone; i++)
            tell(cfd, "%s leaves the router's config and drains (pid %ld)", gone[i]->name,
                 (long)gone[i]->pid);
        retire(o, gone, n_gone);
        for (int i = 0; i < n_gone; i++)
            tell(cfd, "%s stopped", gone[i]->name);
    }
    if (rc == 0)
        tell(cfd, "ok: %d prefill + %d decode workers", want_p, want_d);
}

// Serves one control connection (pump saw it waiting).
static void control_serve(struct up_opts *o)
{
    ctl_pending = false;
    int cfd = accept4(ctl_listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (cfd < 0)
        return;
    struct ucred cred;
    socklen_t cl = sizeof cred;
    if (getsockopt(cfd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0 || cred.uid != getuid()) {
        close(cfd);
        return;
    }
    struct timeval tv = {.tv_sec = 2};
    setsockopt(cfd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(cfd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    char line[128];
    size_t got = 0;
    while (got < sizeof line - 1) {
        ssize_t r = recv(cfd, line + got, 1, 0);
        if (r <= 0 || line[got] == '\n')
            break;
        got++;
    }
    line[got] = '\0';
    ctl_busy = true;
    int p = 0, d = 0;
    char extra;
    if (!strcmp(line, "status"))
        tell(cfd, "ok: %d prefill + %d decode workers", active_count(CHILD_PREFILL),
             active_count(CHILD_DECODE));
    else if (sscanf(line, "scale %d %d %c", &p, &d, &extra) == 2)
        scale(o, p, d, cfd);
    else
        tell(cfd, "error: unknown request \"%.60s\" (a newer or older tandem?)", line);
    ctl_busy = false;
    close(cfd);
}

// ---- tandem scale -------------------------------------------------------------------------

struct scale_opts {
    int port;           // --port: the stack's API port (router, or decode-0 with --no-router)
    const char *socket; // --socket PATH instead
    int n_prefill;      // -1: as it is
    int n_decode;
};

static const struct tdm_flag scale_flags[] = {
    TDM_FLAG_FIELD(struct scale_opts, "port", TDM_FLAG_INT, port, .min = 1, .max = 65535,
                   .metavar = "P", .help = "the stack's API port, as given to tandem up (8000)"),
    TDM_FLAG_FIELD(struct scale_opts, "socket", TDM_FLAG_PTR, socket, .metavar = "PATH",
                   .help = "its control socket instead (tandem up prints it)"),
    TDM_FLAG_FIELD(struct scale_opts, "prefill", TDM_FLAG_INT, n_prefill, .min = 0,
                   .max = MAX_WORKERS, .metavar = "N", .help = "prefill workers wanted"),
    TDM_FLAG_FIELD(struct scale_opts, "decode", TDM_FLAG_INT, n_decode, .min = 1,
                   .max = MAX_WORKERS, .metavar = "M", .help = "decode workers wanted"),
};

static const struct tdm_flags scale_table = {
    .usage = "usage: tandem scale [--port P | --socket PATH] [--prefill N] [--decode M]\n"
             "Adds or removes workers of a running `tandem up` (on this machine, as the same\n"
             "user); without --prefill/--decode it prints the counts.\n",
    .flags = scale_flags,
    .n = sizeof scale_flags / sizeof scale_flags[0],
    .footer = "New workers are awaited and then added to the router; removed ones leave the\n"
              "router first, then drain their requests and stop. Exit 0 when done.\n",
};

static int cmd_scale(int argc, char **argv)
{
    struct scale_opts so = {.port = 8000, .n_prefill = -1, .n_decode = -1};
    char err[512];
    int rc = tdm_flags_parse(&scale_table, &so, argc, argv, NULL, 0, NULL, err, sizeof err);
    if (rc == 1) {
        tdm_flags_help(&scale_table, stdout);
        return 0;
    }
    if (rc != TDM_OK) {
        fprintf(stderr, "tandem scale: %s (see tandem scale --help)\n", err);
        return 2;
    }
    char path[PATH_MAX], dir[PATH_MAX];
    if (so.socket) {
        snprintf(path, sizeof path, "%s", so.socket);
    } else {
        if (run_dir(dir, sizeof dir, err, sizeof err) != 0) {
            fprintf(stderr, "tandem scale: %s\n", err);
            return 1;
        }
        sock_path_for(dir, so.port, path, sizeof path);
    }
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (!path[0] || strlen(path) >= sizeof sa.sun_path) {
        fprintf(stderr, "tandem scale: the control socket's path is too long\n");
        return 1;
    }
    memcpy(sa.sun_path, path, strlen(path) + 1); // length checked above
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        fprintf(stderr,
                "tandem scale: no `tandem up` of yours is running with API port %d here (%s: "
                "%s)\n",
                so.port, path, strerror(errno));
        if (fd >= 0)
            close(fd);
        return 1;
    }
    char req[64];
    if (so.n_prefill < 0 && so.n_decode < 0)
        snprintf(req, sizeof req, "status\n");
    else
        snprintf(req, sizeof req, "scale %d %d\n", so.n_prefill, so.n_decode);
    if (send(fd, req, strlen(req), MSG_NOSIGNAL) != (ssize_t)strlen(req)) {
        fprintf(stderr, "tandem scale: %s: %s\n", path, strerror(errno));
        close(fd);
        return 1;
    }
    // Progress lines until the launcher closes; the last says ok or error.
    char buf[4096], last[1024] = "";
    size_t have = 0;
    for (;;) {
        ssize_t r = read(fd, buf + have, sizeof buf - 1 - have);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        have += (size_t)r;
        buf[have] = '\0';
        char *nl;
        while ((nl = strchr(buf, '\n'))) {
            *nl = '\0';
            printf("%s\n", buf);
            fflush(stdout);
            snprintf(last, sizeof last, "%.*s", (int)(sizeof last - 1), buf);
            have -= (size_t)(nl + 1 - buf);
            memmove(buf, nl + 1, have + 1);
        }
        if (have == sizeof buf - 1)
            have = 0; // an overlong line: dropped
    }
    close(fd);
    if (!strncmp(last, "ok", 2))
        return 0;
    if (!last[0])
        fprintf(stderr, "tandem scale: the launcher closed without an answer\n");
    return 1;
}

// The binaries first: nothing is generated or downloaded for a stack that
// cannot run. Fills bin[router, prefill, decode] and stk.bin; 0, or 1 (told).
static int find_binaries(const struct up_opts *o, char bin[3][PATH_MAX])
{
    if ((!o->no_router && find_bin(o, "tandem-router", "router", bin[0], PATH_MAX)) ||
        (o->n_prefill && find_bin(o, "tandem-prefill", "prefill", bin[1], PATH_MAX)) ||
        find_bin(o, "tandem-decode", "decode", bin[2], PATH_MAX))
        return 1;
    for (int i = 0; i < 3; i++) // for `tandem scale` (prefill's may be found later)
        if ((i == 0 && !o->no_router) || (i == 1 && o->n_prefill) || i == 2)
            snprintf(stk.bin[i], sizeof stk.bin[i], "%s", bin[i]);
    return 0;
}

// The control plane's shared secret (common/edge/transport): one drawn per run
// unless the operator gave one, so the stack's nng ports refuse any other
// process. Children inherit it through the environment.
static void draw_internal_secret(void)
{
    const char *sf = getenv("TANDEM_INTERNAL_SECRET_FILE"), *sv = getenv("TANDEM_INTERNAL_SECRET");
    if ((!sf || !*sf) && (!sv || !*sv)) { // set but empty counts as unset, as for the services
        char secret[65];
        for (int i = 0; i < 4; i++)
            snprintf(secret + 16 * i, 17, "%016llx", (unsigned long long)tdm_net_new_instance_id());
        setenv("TANDEM_INTERNAL_SECRET", secret, 1);
    }
}

// The model: a folder, a Hub id (downloaded or found in the cache), or the
// demo. Writes its folder to model and the name clients send to *served;
// 0, or 1 (told).
static int resolve_model(const struct up_opts *o, char *model, size_t cap, const char **served)
{
    char err[1024];
    *served = o->served_name;
    if (o->model) {
        struct tdm_hub_opts hub = {.progress = TDM_HUB_PROGRESS_AUTO};
        int hrc = tdm_hub_resolve_model(o->model, o->revision, &hub, model, cap, err, sizeof err);
        if (hrc != TDM_OK) {
            say("--model %s: %s", o->model, err);
            return 1;
        }
        struct stat mst;
        if (!*served && !(stat(o->model, &mst) == 0 && S_ISDIR(mst.st_mode)))
            *served = o->model; // a Hub id: clients send the id, as with vllm serve
    } else {
        if (demo_model(o, model, cap) != 0)
            return 1;
        if (!*served)
            *served = "tandem-demo";
    }
    return 0;
}

// Tool choice "auto" (the SDKs' default whenever tools are sent) works out of
// the box: the parser the model's chat template writes calls for, unless
// the user chose (issue 28, item 3).
static void choose_auto_tools(struct up_opts *o, const char *model)
{
    if (!o->no_auto_tools && !(o->tool_parser && *o->tool_parser)) {
        char err[1024];
        enum tdm_oai_tool_parser tp = TDM_OAI_TOOL_PARSER_NONE;
        if (tdm_oai_tool_parser_for_model(model, &tp, err, sizeof err) != TDM_OK)
            say("reading the chat template for tool calls: %s", err);
        if (tp != TDM_OAI_TOOL_PARSER_NONE) {
            o->auto_tool_choice = true;
            o->tool_parser = tdm_oai_tool_parser_name(tp);
            say("tool_choice \"auto\" is on: --enable-auto-tool-choice --tool-call-parser %s "
                "(the model's chat template writes %s calls; --no-auto-tool-choice turns it off)",
                o->tool_parser, o->tool_parser);
        }
    }
    if (o->no_auto_tools)
        o->auto_tool_choice = false;
}

// --threads-per-worker, or the cores shared out among the workers.
static int worker_threads(const struct up_opts *o)
{
    int workers = o->n_prefill + o->n_decode;
    int threads = o->threads_per_worker;
    if (threads == 0) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        threads = cores > workers ? (int)(cores / workers) : 1;
    }
    return threads;
}

// Serves the ready stack until a signal (or, with --restart never, a child's
// death), then stops it. The exit status.
static int serve_until_stopped(struct up_opts *o, const char *cfg_path)
{
    bool dead = false;
    while (!stop_signals && !dead) {
        pump(0.5);
        if (hup_pending) {
            // SIGHUP: the router re-reads its config now (as tandem-router does).
            hup_pending = 0;
            if (!o->no_router && child_running(&children[0])) {
                say("SIGHUP: the router reloads %s", cfg_path);
                kill(children[0].pid, SIGHUP);
            }
        }
        dead = !supervise(o);
        if (ctl_pending && !stop_signals && !dead)
            control_serve(o); // `tandem scale`
    }
    if (dead) {
        stop_stack(o);
        return 1;
    }
    say("stopping: router first, then the workers drain (a second Ctrl-C kills)");
    int rc = stop_stack(o) ? 0 : 1;
    say("stopped");
    return rc;
}

// Starts every child, waits for the stack to be ready, serves, stops. model
// and served must outlive the stack (stk keeps them). The exit status.
static int run_stack(struct up_opts *o, const char *model, const char *served, const char *cfg_path,
                     double t0)
{
    int threads = worker_threads(o);
    if (device_may_be_gpu(o) && o->gpu_util == 0)
        o->gpu_util = gpu_share(o); // fixed now: workers `tandem scale` adds get the same
    stk.model = model;
    stk.served = served;
    stk.threads = threads;
    snprintf(stk.cfg_path, sizeof stk.cfg_path, "%s", cfg_path);
    control_open(children[0].http_port);
    say("starting %s%d decode + %d prefill workers (%d threads each), model %s",
        o->no_router ? "" : "the router, ", o->n_decode, o->n_prefill, threads, model);
    if (device_may_be_gpu(o))
        say("workers on --device %s; on a GPU each gets --gpu-memory-utilization %.2f of it",
            o->device ? o->device : "auto", gpu_share(o));
    if (launch_all(o, model, served, cfg_path, threads) != 0) {
        stop_stack(o);
        return 1;
    }
    int wrc = wait_ready(o);
    if (wrc == 0) {
        print_ready(o, model, served, cfg_path, t0);
        return serve_until_stopped(o, cfg_path);
    }
    if (wrc == 1) {
        say("stopping before the stack was ready");
        return stop_stack(o) ? 0 : 1;
    }
    say("startup failed: stopping the rest");
    stop_stack(o);
    return 1;
}

static int cmd_up(int argc, char **argv)
{
    struct up_opts o;
    opts_default(&o);
    int prc = opts_parse(&o, argc, argv);
    if (prc == 1) {
        tdm_flags_help(&up_table, stdout);
        return 0;
    }
    if (prc != 0)
        return 2;
    use_color = isatty(1) && !getenv("NO_COLOR");
    tdm_log_set_role("tandem");
    tdm_log_set_level_name(o.log_level);
    double t0 = tdm_now();
    int rc = 1;
    char cfg_dir[PATH_MAX] = "", cfg_path[PATH_MAX] = "";

    char bin[3][PATH_MAX];
    if (find_binaries(&o, bin) != 0)
        return 1;
    draw_internal_secret();
    if (!o.no_router)
        add_child(CHILD_ROUTER, 0, bin[0]);
    for (int i = 0; i < o.n_decode; i++)
        add_child(CHILD_DECODE, i, bin[2]);
    for (int i = 0; i < o.n_prefill; i++)
        add_child(CHILD_PREFILL, i, bin[1]);
    if (assign_ports(&o, 0) != 0) // a taken port is reported before any download
        return 1;

    char model[PATH_MAX]; // stk.model points here while the stack runs
    const char *served;
    if (resolve_model(&o, model, sizeof model, &served) != 0)
        return 1;
    choose_auto_tools(&o, model);

    // Again just before the start: a long download gave other programs time to
    // take a port found free earlier.
    if (assign_ports(&o, 0) != 0)
        return 1;
    // Until here a Ctrl-C simply ends the launcher (a download resumes next time;
    // no child runs yet); from here on it stops the stack in order.
    if (install_signals() != 0) {
        say("cannot install signal handlers: %s", strerror(errno));
        return 1;
    }
    if (o.no_router ||
        write_router_config(&o, cfg_dir, sizeof cfg_dir, cfg_path, sizeof cfg_path) == 0)
        rc = run_stack(&o, model, served, cfg_path, t0);

    control_close();
    for (int i = 0; i < n_children; i++) {
        free(children[i].argv);
        children[i].argv = NULL;
    }
    if (cfg_path[0])
        unlink(cfg_path);
    if (cfg_dir[0])
        rmdir(cfg_dir);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc >= 2 && !strcmp(argv[1], "up"))
        return cmd_up(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "scale"))
        return cmd_scale(argc - 1, argv + 1);
    if (argc >= 2 &&
        (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help"))) {
        fputs("usage: tandem COMMAND [options]\n"
              "\n"
              "Commands:\n"
              "  up         run a whole stack on this machine: the router, N prefill and M\n"
              "             decode workers (a demo model unless --model says otherwise)\n"
              "  scale      add or remove workers of a running `tandem up`: tandem scale\n"
              "             [--port P] [--prefill N] [--decode M] (see tandem scale --help)\n"
              "  --version  print the version\n"
              "\n"
              "Options of `tandem up`:\n",
              stdout);
        tdm_flags_help(&up_table, stdout);
        fputs("\nThe services and tools are programs of their own, each with --help:\n"
              "tandem-router, tandem-prefill, tandem-decode, tandem-mkmodel, tandem-generate,\n"
              "tandem-tokenize, tandem-download, tandem-bench, tandem-bench-engine.\n",
              stdout);
        return 0;
    }
    if (argc >= 2 && !strcmp(argv[1], "--version")) {
        printf("tandem %s\n", TANDEM_VERSION);
        return 0;
    }
    if (argc >= 2)
        fprintf(stderr, "tandem: unknown command \"%s\" (see tandem --help)\n", argv[1]);
    else
        fprintf(stderr, "usage: tandem COMMAND [options] (see tandem --help)\n");
    return 2;
}
