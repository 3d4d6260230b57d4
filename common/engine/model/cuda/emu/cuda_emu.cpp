// SPDX-License-Identifier: Apache-2.0
// cuda_emu: the fiber scheduler behind cuda_emu.h. Each launch runs the grid's
// blocks one after another; inside a block every thread is a ucontext fiber
// with its own stack, and the scheduler runs each runnable fiber until it
// finishes or waits (block barrier or warp barrier), then releases barriers
// whose participants have all arrived. A state where some fibers wait and no
// barrier can be released is a kernel bug (deadlock, divergent barrier) and
// aborts with a message naming it.
//
// Under AddressSanitizer the stack switches are announced with
// __sanitizer_{start,finish}_switch_fiber so its stack bookkeeping follows.
//
// The switch itself: on x86-64 a few instructions saving the callee-saved
// registers and the FP control words (swapcontext also saves the signal mask,
// one system call per switch, which made the emulated model tests several
// times slower); elsewhere, and under AddressSanitizer, ucontext.
#include "cuda_emu.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <ucontext.h>

#if defined(__SANITIZE_ADDRESS__)
#define TDM_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TDM_EMU_ASAN 1
#endif
#endif
#ifdef TDM_EMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

// Not under ASan: a fiber that ends by switching away leaves its frames'
// redzones poisoned on a stack the next block reuses; ucontext's return
// through uc_link unwinds them.
#if defined(__x86_64__) && !defined(TDM_EMU_UCONTEXT) && !defined(TDM_EMU_ASAN)
#define TDM_EMU_ASM_SWITCH 1
// Saves rbp, rbx, r12-r15, MXCSR and the x87 control word on the current
// stack, stores the stack pointer in *save_sp, and resumes the context whose
// stack pointer is load_sp (saved the same way, or built by init_stack).
extern "C" void tdm_emu_switch(void **save_sp, void *load_sp);
__asm__(".text\n"
        ".globl tdm_emu_switch\n"
        ".type tdm_emu_switch,@function\n"
        "tdm_emu_switch:\n"
        "    pushq %rbp\n"
        "    pushq %rbx\n"
        "    pushq %r12\n"
        "    pushq %r13\n"
        "    pushq %r14\n"
        "    pushq %r15\n"
        "    subq $8, %rsp\n"
        "    stmxcsr (%rsp)\n"
        "    fnstcw 4(%rsp)\n"
        "    movq %rsp, (%rdi)\n"
        "    movq %rsi, %rsp\n"
        "    ldmxcsr (%rsp)\n"
        "    fldcw 4(%rsp)\n"
        "    addq $8, %rsp\n"
        "    popq %r15\n"
        "    popq %r14\n"
        "    popq %r13\n"
        "    popq %r12\n"
        "    popq %rbx\n"
        "    popq %rbp\n"
        "    ret\n"
        ".size tdm_emu_switch, .-tdm_emu_switch\n");
#endif

#include <atomic>
#include <deque>
#include <mutex>
#include <vector>

namespace tdm_emu
{
// One grid runs at a time in the process: the block coordinates and every
// kernel's shared memory (function-local statics) are process-wide, and two
// engines in one test process (a prefill and a decode worker, pd_kvx_test)
// launch from their own threads. Graph capture stays one at a time (those
// tests run eagerly).
static std::mutex grid_mu;
dim3 cur_thread_idx, cur_block_idx, cur_block_dim, cur_grid_dim;

namespace
{
enum fiber_state { RUNNABLE, AT_BLOCK_BARRIER, AT_WARP_BARRIER, DONE };

constexpr size_t STACK_BYTES = 256 * 1024;
constexpr unsigned MAX_THREADS = 1024;
constexpr size_t GATHER_BYTES = 32;

struct fiber {
#ifdef TDM_EMU_ASM_SWITCH
    void *sp; // saved stack pointer while not running
#else
    ucontext_t ctx;
#endif
    fiber_state state;
    dim3 tid;
};

struct scheduler {
#ifdef TDM_EMU_ASM_SWITCH
    void *main_sp;
#else
    ucontext_t main_ctx;
#endif
    std::vector<fiber> fibers;
    std::vector<uint64_t> slots; // [threads] one shuffle slot per lane
    std::vector<unsigned char> gather; // [threads][GATHER_BYTES] warp_gather's slots
    char *stacks = nullptr;      // [MAX_THREADS][STACK_BYTES], mmap'd once, untouched until used
    int cur = -1;
    const std::function<void()> *body = nullptr;
    unsigned long long blocks = 0;
#ifdef TDM_EMU_ASAN
    const void *main_stack_bottom = nullptr;
    size_t main_stack_size = 0;
#endif
};

scheduler S;

[[noreturn]] void die(const char *what)
{
    fprintf(stderr, "cuda_emu: kernel bug: %s (block %u,%u,%u)\n", what, cur_block_idx.x,
            cur_block_idx.y, cur_block_idx.z);
    abort();
}

char *stack_of(int i)
{
    return S.stacks + (size_t)i * STACK_BYTES;
}

// Fiber side: hands control back to the scheduler and returns when resumed.
void yield_to_scheduler()
{
    fiber &f = S.fibers[(size_t)S.cur];
#ifdef TDM_EMU_ASAN
    void *fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, S.main_stack_bottom, S.main_stack_size);
#endif
#ifdef TDM_EMU_ASM_SWITCH
    tdm_emu_switch(&f.sp, S.main_sp);
#else
    swapcontext(&f.ctx, &S.main_ctx);
#endif
#ifdef TDM_EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

void fiber_entry()
{
#ifdef TDM_EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &S.main_stack_bottom, &S.main_stack_size);
#endif
    (*S.body)();
    S.fibers[(size_t)S.cur].state = DONE;
#ifdef TDM_EMU_ASAN
    // The fiber ends: no fake stack to keep.
    __sanitizer_start_switch_fiber(nullptr, S.main_stack_bottom, S.main_stack_size);
#endif
#ifdef TDM_EMU_ASM_SWITCH
    void *dead_sp;
    tdm_emu_switch(&dead_sp, S.main_sp); // never resumed
    die("a finished fiber was resumed");
#endif
    // ucontext: uc_link resumes the scheduler.
}

// Scheduler side: runs fiber i until it waits or finishes.
void resume(int i)
{
    fiber &f = S.fibers[(size_t)i];
    S.cur = i;
    cur_thread_idx = f.tid;
#ifdef TDM_EMU_ASAN
    void *fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, stack_of(i), STACK_BYTES);
#endif
#ifdef TDM_EMU_ASM_SWITCH
    tdm_emu_switch(&S.main_sp, f.sp);
#else
    swapcontext(&S.main_ctx, &f.ctx);
#endif
#ifdef TDM_EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
    S.cur = -1;
}

// Apart from run_block: getcontext returns twice, which would make the
// compiler assume run_block's locals can be clobbered.
__attribute__((noinline)) void init_fiber(unsigned i)
{
    fiber &f = S.fibers[i];
    f.state = RUNNABLE;
    f.tid = dim3(i % cur_block_dim.x, (i / cur_block_dim.x) % cur_block_dim.y,
                 i / (cur_block_dim.x * cur_block_dim.y));
#ifdef TDM_EMU_ASM_SWITCH
    // A stack tdm_emu_switch can resume: from the top (16-byte aligned) a
    // zero return address for fiber_entry (so it starts as if called: rsp =
    // 8 mod 16), fiber_entry as the address `ret` takes, six zero registers,
    // then the current MXCSR and x87 control word.
    uintptr_t top = ((uintptr_t)stack_of((int)i) + STACK_BYTES) & ~(uintptr_t)15;
    uint64_t *sp = (uint64_t *)top;
    *--sp = 0;
    *--sp = (uint64_t)(uintptr_t)&fiber_entry;
    for (int r = 0; r < 6; r++)
        *--sp = 0;
    uint32_t csr[2];
    __asm__ volatile("stmxcsr %0" : "=m"(csr[0]));
    uint16_t cw;
    __asm__ volatile("fnstcw %0" : "=m"(cw));
    csr[1] = cw;
    --sp;
    memcpy(sp, csr, 8);
    f.sp = sp;
#else
    if (getcontext(&f.ctx) != 0)
        die("getcontext failed");
    f.ctx.uc_stack.ss_sp = stack_of((int)i);
    f.ctx.uc_stack.ss_size = STACK_BYTES;
    f.ctx.uc_link = &S.main_ctx;
    makecontext(&f.ctx, fiber_entry, 0);
#endif
}

void run_block(unsigned nthreads)
{
    for (unsigned i = 0; i < nthreads; i++)
        init_fiber(i);
    unsigned nwarps = nthreads / 32;
    for (;;) {
        for (unsigned i = 0; i < nthreads; i++)
            if (S.fibers[i].state == RUNNABLE)
                resume((int)i);
        // Every fiber now waits or is done: release what can be released.
        unsigned done = 0, at_block = 0;
        bool released = false;
        for (unsigned w = 0; w < nwarps; w++) {
            unsigned wd = 0, ww = 0;
            for (unsigned l = 0; l < 32; l++) {
                fiber_state st = S.fibers[w * 32 + l].state;
                wd += st == DONE;
                ww += st == AT_WARP_BARRIER;
                at_block += st == AT_BLOCK_BARRIER;
            }
            done += wd;
            if (ww == 32) {
                for (unsigned l = 0; l < 32; l++)
                    S.fibers[w * 32 + l].state = RUNNABLE;
                released = true;
            } else if (ww > 0 && wd > 0) {
                die("warp shuffle with lanes that already exited");
            }
        }
        if (done == nthreads)
            return;
        if (released)
            continue;
        if (at_block + done == nthreads) {
            if (done > 0)
                die("__syncthreads reached after some threads of the block exited");
            for (unsigned i = 0; i < nthreads; i++)
                S.fibers[i].state = RUNNABLE;
            continue;
        }
        die("deadlock: threads wait at barriers that can never complete");
    }
}
} // namespace

// Work recorded by a capture, in stream order.
struct emu_graph {
    std::vector<std::function<void()>> work;
};
static emu_graph *capture_graph; // non-NULL while capturing

// A stream: its queued work (deferred mode) and how much of what was issued
// has run. One thread runs a stream's work at a time (run_mu), in order;
// q_mu guards the queue and the counts.
struct emu_stream {
    std::mutex run_mu, q_mu;
    std::deque<std::function<void()>> q;
    unsigned long long issued = 0, done = 0;
};
static emu_stream device_stream; // NULL: the device's own stream
static std::atomic<bool> deferred{false};

static emu_stream *stream_of(void *s)
{
    return s != nullptr ? (emu_stream *)s : &device_stream;
}

// Runs s's queued work until `upto` items have run (or the queue is empty).
static void drain(emu_stream *s, unsigned long long upto)
{
    std::lock_guard<std::mutex> running(s->run_mu);
    for (;;) {
        std::function<void()> w;
        {
            std::lock_guard<std::mutex> q(s->q_mu);
            if (s->done >= upto || s->q.empty())
                return;
            w = std::move(s->q.front());
            s->q.pop_front();
        }
        w();
        std::lock_guard<std::mutex> q(s->q_mu);
        s->done++;
    }
}

static void drain_all(emu_stream *s)
{
    unsigned long long upto;
    {
        std::lock_guard<std::mutex> q(s->q_mu);
        upto = s->issued;
    }
    drain(s, upto);
}

// Issues w on stream s: recorded by a capture of the device stream, queued in
// deferred mode, else run now (after anything still queued from deferred mode).
static void issue(void *stream, std::function<void()> w)
{
    emu_stream *s = stream_of(stream);
    if (stream == nullptr && capture_graph != nullptr) {
        capture_graph->work.push_back(std::move(w));
        return;
    }
    if (deferred.load()) {
        std::lock_guard<std::mutex> q(s->q_mu);
        s->q.push_back(std::move(w));
        s->issued++;
        return;
    }
    drain_all(s);
    w();
}

static void run_grid(dim3 grid, dim3 block, size_t shmem, const std::function<void()> &body);

static std::mutex log_mu;
static bool log_on;
static std::vector<tdm_emu_launch> launch_log;

void launch(void *stream, const char *name, dim3 grid, dim3 block, size_t shmem,
            const std::function<void()> &body)
{
    tdm_emu_log_launch(name, (unsigned long long)grid.x * grid.y * grid.z);
    issue(stream, [=]() { run_grid(grid, block, shmem, body); });
}

static void run_grid(dim3 grid, dim3 block, size_t shmem, const std::function<void()> &body)
{
    std::lock_guard<std::mutex> hold(grid_mu);
    unsigned nthreads = block.x * block.y * block.z;
    if (shmem != 0)
        die("dynamic shared memory is not supported by the emulator");
    if (nthreads == 0 || nthreads > MAX_THREADS || nthreads % 32 != 0)
        die("block size must be a positive multiple of 32, at most 1024");
    if (S.stacks == nullptr) {
        void *p = mmap(nullptr, (size_t)MAX_THREADS * STACK_BYTES, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED)
            die("cannot map fiber stacks");
        S.stacks = (char *)p;
        S.fibers.resize(MAX_THREADS);
        S.slots.resize(MAX_THREADS);
        S.gather.resize((size_t)MAX_THREADS * GATHER_BYTES);
    }
    if (S.body != nullptr)
        die("kernel launched from inside a kernel");
    S.body = &body;
    cur_grid_dim = grid;
    cur_block_dim = block;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                cur_block_idx = dim3(x, y, z);
                run_block(nthreads);
                S.blocks++;
            }
    S.body = nullptr;
}

static int linear_tid()
{
    return (int)(threadIdx.x + threadIdx.y * blockDim.x + threadIdx.z * blockDim.x * blockDim.y);
}

void syncthreads()
{
    S.fibers[(size_t)S.cur].state = AT_BLOCK_BARRIER;
    yield_to_scheduler();
}

int lane_id()
{
    return linear_tid() % 32;
}

uint64_t warp_exchange(uint64_t mine, int src)
{
    int t = linear_tid();
    int base = t - t % 32;
    S.slots[(size_t)t] = mine;
    S.fibers[(size_t)S.cur].state = AT_WARP_BARRIER;
    yield_to_scheduler();
    uint64_t got = (src >= 0 && src < 32) ? S.slots[(size_t)(base + src)] : mine;
    // Nobody may overwrite a slot before every lane has read.
    S.fibers[(size_t)S.cur].state = AT_WARP_BARRIER;
    yield_to_scheduler();
    return got;
}

void warp_gather(const void *mine, size_t bytes, void *all)
{
    if (bytes > GATHER_BYTES)
        die("warp_gather of more than 32 bytes a lane");
    int t = linear_tid();
    int base = t - t % 32;
    memcpy(&S.gather[(size_t)t * GATHER_BYTES], mine, bytes);
    S.fibers[(size_t)S.cur].state = AT_WARP_BARRIER;
    yield_to_scheduler();
    for (int l = 0; l < 32; l++)
        memcpy((unsigned char *)all + (size_t)l * bytes,
               &S.gather[(size_t)(base + l) * GATHER_BYTES], bytes);
    S.fibers[(size_t)S.cur].state = AT_WARP_BARRIER;
    yield_to_scheduler();
}

namespace
{
struct mma_frag {
    uint32_t a[4], b[2];
};

float bf16_half(uint32_t reg, int k)
{
    uint32_t u = (k % 2 ? reg >> 16 : reg & 0xffffu) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// Element (row, k) of the 16x16 A and (k, col) of the 16x8 B, found in the
// lane and register the PTX ISA's m16n8k16 layout puts them in (groupID =
// lane / 4, threadID_in_group = lane % 4): A's a0..a7 (4 registers of two
// bf16, the lower index in the low half) are rows groupID (registers 0, 2)
// and groupID + 8 (1, 3), columns tig * 2 + {0, 1} (registers 0, 1) and
// + 8 (2, 3); B's b0..b3 are rows tig * 2 + {0, 1} (register 0) and + 8
// (register 1), column groupID.
float mma_a(const mma_frag *all, int row, int k)
{
    return bf16_half(all[(row % 8) * 4 + (k % 8) / 2].a[row / 8 + 2 * (k / 8)], k);
}

float mma_b(const mma_frag *all, int k, int col)
{
    return bf16_half(all[col * 4 + (k % 8) / 2].b[k / 8], k);
}
} // namespace

// D = A B + C. A product of two bf16 is exact in f32 (8-bit significands);
// the emulator adds the 16 products to c in k order in double and rounds to
// f32 once. The hardware's internal order and rounding of the sum are not
// modelled bit for bit: tests of an mma kernel against a GPU use a tolerance.
void mma_m16n8k16_bf16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4])
{
    mma_frag mine, all[32];
    memcpy(mine.a, a, sizeof mine.a);
    memcpy(mine.b, b, sizeof mine.b);
    warp_gather(&mine, sizeof mine, all);
    int lane = lane_id(), g = lane / 4, tig = lane % 4;
    for (int e = 0; e < 4; e++) {
        // c0, c1: row groupID, columns tig * 2 + {0, 1}; c2, c3: row groupID + 8.
        int row = g + (e / 2) * 8, col = tig * 2 + e % 2;
        double acc = c[e];
        for (int k = 0; k < 16; k++)
            acc += (double)mma_a(all, row, k) * (double)mma_b(all, k, col);
        d[e] = (float)acc;
    }
}

// Lane 8 m + i gives the address of row i of matrix m (16 bytes, aligned);
// register m of lane L gets row L / 4, elements 2 (L % 4) + {0, 1} of matrix
// m, or with .trans column L / 4, rows 2 (L % 4) + {0, 1}.
void ldmatrix_x4(uint32_t r[4], const void *row, bool trans)
{
    if ((uintptr_t)row % 16 != 0)
        die("ldmatrix row address not 16-byte aligned");
    const unsigned char *rows[32];
    warp_gather(&row, sizeof row, rows);
    int lane = lane_id();
    for (int m = 0; m < 4; m++) {
        uint16_t lo, hi;
        if (trans) {
            memcpy(&lo, rows[m * 8 + 2 * (lane % 4)] + 2 * (lane / 4), 2);
            memcpy(&hi, rows[m * 8 + 2 * (lane % 4) + 1] + 2 * (lane / 4), 2);
        } else {
            memcpy(&lo, rows[m * 8 + lane / 4] + 4 * (lane % 4), 2);
            memcpy(&hi, rows[m * 8 + lane / 4] + 4 * (lane % 4) + 2, 2);
        }
        r[m] = (uint32_t)lo | (uint32_t)hi << 16;
    }
}

unsigned long long blocks_run()
{
    return S.blocks;
}

void kernel_bug(const char *what)
{
    die(what);
}
} // namespace tdm_emu

using tdm_emu::capture_graph;
using tdm_emu::emu_graph;

extern "C" void tdm_emu_capture_begin(void)
{
    if (capture_graph != nullptr)
        tdm_emu::die("capture begun twice");
    capture_graph = new emu_graph;
}

extern "C" void *tdm_emu_capture_end(void)
{
    emu_graph *g = capture_graph;
    capture_graph = nullptr;
    return g;
}

extern "C" int tdm_emu_capturing(void)
{
    return capture_graph != nullptr;
}

extern "C" void tdm_emu_stream_work(void *stream, void (*fn)(void *arg), const void *arg,
                                    size_t arg_bytes)
{
    std::vector<unsigned char> copy((const unsigned char *)arg,
                                    (const unsigned char *)arg + arg_bytes);
    tdm_emu::issue(stream, [fn, copy]() mutable { fn(copy.data()); });
}

using tdm_emu::emu_stream;

extern "C" void tdm_emu_launch_log(int on)
{
    std::lock_guard<std::mutex> hold(tdm_emu::log_mu);
    tdm_emu::log_on = on != 0;
    if (on)
        tdm_emu::launch_log.clear();
}

extern "C" size_t tdm_emu_launches(struct tdm_emu_launch *out, size_t cap)
{
    std::lock_guard<std::mutex> hold(tdm_emu::log_mu);
    for (size_t i = 0; i < cap && i < tdm_emu::launch_log.size(); i++)
        out[i] = tdm_emu::launch_log[i];
    return tdm_emu::launch_log.size();
}

extern "C" void tdm_emu_log_launch(const char *name, unsigned long long ctas)
{
    std::lock_guard<std::mutex> hold(tdm_emu::log_mu);
    if (tdm_emu::log_on)
        tdm_emu::launch_log.push_back({name, ctas, 0});
}

extern "C" void tdm_emu_log_gemm(const char *name, int n)
{
    std::lock_guard<std::mutex> hold(tdm_emu::log_mu);
    if (tdm_emu::log_on)
        tdm_emu::launch_log.push_back({name, 0, n});
}

extern "C" void tdm_emu_defer(int on)
{
    tdm_emu::deferred.store(on != 0);
}

extern "C" unsigned long long tdm_emu_pending(void *stream)
{
    emu_stream *s = tdm_emu::stream_of(stream);
    std::lock_guard<std::mutex> q(s->q_mu);
    return s->issued - s->done;
}

extern "C" void *tdm_emu_stream_new(void)
{
    return new emu_stream;
}

extern "C" void tdm_emu_stream_free(void *stream)
{
    if (stream == nullptr)
        return;
    tdm_emu::drain_all((emu_stream *)stream);
    delete (emu_stream *)stream;
}

extern "C" void tdm_emu_stream_sync(void *stream)
{
    tdm_emu::drain_all(tdm_emu::stream_of(stream));
}

// An event: the stream it was last recorded on and how many items had been
// issued there then (stream NULL: never recorded, complete).
struct emu_event {
    std::mutex mu;
    emu_stream *s = nullptr;
    unsigned long long mark = 0;
};

extern "C" void *tdm_emu_event_new(void)
{
    return new emu_event;
}

extern "C" void tdm_emu_event_free(void *event)
{
    delete (emu_event *)event;
}

extern "C" void tdm_emu_event_record(void *event, void *stream)
{
    if (stream == nullptr && capture_graph != nullptr)
        tdm_emu::die("event recorded on the device stream while capturing");
    emu_stream *s = tdm_emu::stream_of(stream);
    unsigned long long mark;
    {
        std::lock_guard<std::mutex> q(s->q_mu);
        mark = s->issued;
    }
    emu_event *e = (emu_event *)event;
    std::lock_guard<std::mutex> hold(e->mu);
    e->s = s;
    e->mark = mark;
}

static void event_mark(void *event, emu_stream **s, unsigned long long *mark)
{
    emu_event *e = (emu_event *)event;
    std::lock_guard<std::mutex> hold(e->mu);
    *s = e->s;
    *mark = e->mark;
}

extern "C" void tdm_emu_event_sync(void *event)
{
    emu_stream *s;
    unsigned long long mark;
    event_mark(event, &s, &mark);
    if (s != nullptr)
        tdm_emu::drain(s, mark);
}

extern "C" void tdm_emu_stream_wait_event(void *stream, void *event)
{
    emu_stream *s;
    unsigned long long mark;
    event_mark(event, &s, &mark); // the record as of now, as cudaStreamWaitEvent takes it
    if (s == nullptr || s == tdm_emu::stream_of(stream))
        return; // complete, or earlier on the same stream
    tdm_emu::issue(stream, [s, mark]() { tdm_emu::drain(s, mark); });
}

static unsigned long long graph_launches;

extern "C" unsigned long long tdm_emu_graph_launches(void)
{
    return graph_launches;
}

extern "C" void tdm_emu_graph_launch(void *graph)
{
    graph_launches++;
    if (capture_graph != nullptr)
        tdm_emu::die("graph launched while capturing");
    emu_graph *g = (emu_graph *)graph;
    tdm_emu::issue(nullptr, [g]() {
        for (auto &w : g->work)
            w();
    });
}

extern "C" void tdm_emu_graph_free(void *graph)
{
    delete (emu_graph *)graph;
}
