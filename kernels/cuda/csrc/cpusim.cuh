// cpusim: the CUDA C kernels of kernels/cuda/csrc/*.cu compiled by g++ and run on CPU threads, to prove their
// indexing, reductions, tails and barriers on a machine without a GPU (common.cuh includes this under -DCPUSIM).
//
//     g++ -std=c++20 -O1 -pthread -ffp-contract=off -DCPUSIM -DCPUSIM_SMALL -I csrc -x c++ layernorm.cu -o x && ./x
//
// Model of execution (what a kernel sees):
//   - a launch runs its blocks one after another on blockDim.x * y * z fibers (user-level threads, each with its
//     own stack and threadIdx, all on the launching OS thread; see "a block's CUDA threads as fibers" below), so
//     `__shared__` (defined as `static`) is one array per kernel shared by the running block's threads, as on a GPU;
//   - __syncthreads() is a barrier of the block, __syncwarp() and every warp shuffle / vote a barrier of the
//     thread's warp (32 consecutive linear thread ids); a thread that returns drops out of both, as exited threads
//     stop counting on a GPU; between two barriers the threads run one after another in thread order;
//   - shuffles exchange through a double-buffered per-warp buffer: one barrier per call, every lane of the warp must
//     call (a full-mask shuffle with an exited or diverged lane is undefined on a GPU; here, where no barrier can
//     complete, the program stops with "cpusim: deadlock");
//   - float arithmetic is IEEE float32 in program order (-ffp-contract=off: no fused multiply-adds), __expf is expf,
//     rsqrtf 1/sqrtf: bit differences against a GPU are rounding-level, never structural.
// What it cannot show: speed, memory coalescing, bank conflicts, register spills, the weak memory model between
// blocks (blocks never run concurrently here), ldmatrix and the other inline assembly; tensor cores (mma.sync),
// cp.async and fp16 / bf16 storage only under -DCPUSIM_HALF (emulated below: their fragment layouts, not their speed).
//
// Host side: cudaMalloc / cudaMemcpy / events shims for the standalone mains, and LAUNCH(kernel, grid, block,
// args...) which is kernel<<<grid, block>>>(args...) under nvcc and cpusim::launch here (LAUNCH_SMEM with dynamic
// shared memory, which a kernel declares with DYN_SHARED(type, name); here one NaN-poisoned buffer per launch). With -DCPUSIM_LIB it also
// exports `cpusim_launch(trampoline, args, grid, block)` for kernels/cuda/emulate.py (ctypes).
#pragma once
#ifdef CPUSIM

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>
#include <sys/mman.h>
#include <unistd.h>
#if !defined(__x86_64__) || defined(CPUSIM_UCONTEXT)
#include <ucontext.h>
#endif

#define __global__
#define __device__
#define __constant__                        // a plain global (emulate.py's get_global finds it)
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#ifdef CPUSIM_PARSE                 // kernels/cuda/emulate.py reads each kernel's launch bounds off the preprocessed text
#define __launch_bounds__(...) cpusim_launch_bounds(__VA_ARGS__)
#else
#define __launch_bounds__(...)
#endif
#define __maxnreg__(n)                      // a register cap (ptxas): nothing on CPU threads

struct uint3 { unsigned x, y, z; };
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

inline thread_local uint3 threadIdx, blockIdx;
inline thread_local dim3 blockDim, gridDim;

// CUDA's integer and float min / max overloads
template <class A, class B> inline std::common_type_t<A, B> min(A a, B b) { return b < a ? b : a; }
template <class A, class B> inline std::common_type_t<A, B> max(A a, B b) { return a < b ? b : a; }

inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __fmul_rn(float a, float b) { return a * b; }      // -ffp-contract=off: never fused anyway
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }     // IEEE division and square root, as the GPU's _rn
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
inline float __saturatef(float x) { return x < 0.f ? 0.f : x > 1.f ? 1.f : x; }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline int __float_as_int(float x) { int i; std::memcpy(&i, &x, 4); return i; }
inline float __int_as_float(int i) { float x; std::memcpy(&x, &i, 4); return x; }
inline unsigned __float_as_uint(float x) { unsigned i; std::memcpy(&i, &x, 4); return i; }
inline float __uint_as_float(unsigned i) { float x; std::memcpy(&x, &i, 4); return x; }
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) { return std::atomic_ref<unsigned int>(*p).fetch_add(v); }

namespace cpusim {

// ---- a block's CUDA threads as fibers ---------------------------------------------------------------------------
// Every CUDA thread of the running block is a fiber (its own stack, its registers saved when it waits) on the one
// OS thread that launched the kernel. A fiber runs until it waits (a barrier, a shuffle, a vote, mma.sync's
// exchange), then hands the OS thread to the next fiber in thread order. Earlier these were OS threads, one a CUDA
// thread: a barrier of 256 threads was 256 futex wake-ups and as many context switches in the OS kernel. On this
// project's 2-core machine, nothing else running, layernorm.cu's main took 24.8 s that way (38.6 s of system time,
// 10.5 of user time) and takes 0.51 s as fibers; attention_backward.cu's 8.6 s and 2.0 s. A fiber switch is a
// handful of instructions (x86-64: the callee-saved registers, the stack pointer, the SSE and x87 control words);
// elsewhere, or with -DCPUSIM_UCONTEXT, ucontext's swapcontext (a system call a switch: the layernorm main 5.9 s).
// What the order means for the kernels proven here: between two barriers the threads of a block run one after
// another, thread 0 first, each to its next wait. A thread that reads shared memory another thread writes in the
// same phase (a barrier missing) reads the old value when the writer's id is higher and the new one when lower:
// the usual reduction tree (thread t reads t + s) and a buffer refilled too early (thread 0 refills before thread 1
// reads) show up as wrong values, every run the same (tests/test_cuda_cpusim.py has both kinds of mutant);
// CPUSIM_ORDER=reverse runs every phase last thread first, for the other direction. Threads that wait for each
// other in a way no barrier resolves (a __syncthreads that some live thread never reaches while it waits for a
// shuffle or another barrier) stop the program with "cpusim: deadlock" instead of hanging.
#if defined(__x86_64__) && !defined(CPUSIM_UCONTEXT)
// save the callee-saved registers and the control words on this stack, store its pointer in *from, load `to`'s
// and return into the fiber that saved it (a new fiber: into fiber_main, its frame made by Fibers::start)
extern "C" void cpusim_fiber_switch(void** from, void* to);
asm(R"(
    .text
    .weak cpusim_fiber_switch
    .hidden cpusim_fiber_switch
    .type cpusim_fiber_switch, @function
cpusim_fiber_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cpusim_fiber_switch, .-cpusim_fiber_switch
)");
struct Context { void* sp = nullptr; };
inline void jump(Context& from, Context& to) { cpusim_fiber_switch(&from.sp, to.sp); }
#else
struct Context { ucontext_t uc; };
inline void jump(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

struct Fiber {
    Context ctx;
    char* stack = nullptr;              // mmap'd, its lowest page a guard (an overflow faults, never corrupts)
    bool done = false;
    int ltid = 0;                       // what the fiber sees as its thread, restored whenever it resumes
    uint3 tid{}, bid{};
};

[[noreturn]] inline void fiber_main();

struct Fibers {
    static constexpr size_t STACK = 1 << 20;            // 1 MiB a CUDA thread (virtual; pages touched are kept)
    std::vector<Fiber> f;               // grows to the largest block seen; stacks reused launch after launch
    Context host;                       // the launching OS thread's own context, resumed when every fiber is done
    int n = 0, cur = 0, live = 0;
    long stalls = 0;                    // waits in a row that found their condition unmet: > 2 n live is a deadlock
    bool reverse = false;               // CPUSIM_ORDER=reverse
    std::function<void(int)> job;
    std::mutex launch_mu;               // one launch at a time (the globals are the running launch's)
    Fibers() {
        const char* o = std::getenv("CPUSIM_ORDER");
        reverse = o && std::strcmp(o, "reverse") == 0;
    }
    void start(Fiber& x) {
        if (!x.stack) {
            const size_t page = (size_t)sysconf(_SC_PAGESIZE);
            void* m = mmap(nullptr, STACK + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                           -1, 0);
            if (m == MAP_FAILED) {
                std::fprintf(stderr, "cpusim: could not map a fiber's stack (%zu bytes)\n", STACK);
                std::abort();
            }
            mprotect(m, page, PROT_NONE);
            x.stack = static_cast<char*>(m) + page;
        }
        x.done = false;
#if defined(__x86_64__) && !defined(CPUSIM_UCONTEXT)
        // the frame cpusim_fiber_switch pops: control words, r15 r14 r13 r12 rbx rbp (zero), then fiber_main's
        // address as the return address, at a 16-byte boundary, so that fiber_main starts as if called (rsp = 8 mod
        // 16), with a zero above it for its own (never used) return address
        auto top = (reinterpret_cast<std::uintptr_t>(x.stack + STACK) & ~std::uintptr_t(15)) - 16;
        void** a = reinterpret_cast<void**>(top);
        a[0] = reinterpret_cast<void*>(&fiber_main);
        a[1] = nullptr;
        for (int i = 1; i <= 6; i++) a[-i] = nullptr;
        unsigned* cw = reinterpret_cast<unsigned*>(top - 56);
        unsigned short x87;
        asm volatile("fnstcw %0" : "=m"(x87));
        cw[0] = __builtin_ia32_stmxcsr();
        cw[1] = x87;
        x.ctx.sp = reinterpret_cast<void*>(top - 56);
#else
        getcontext(&x.ctx.uc);
        x.ctx.uc.uc_stack.ss_sp = x.stack;
        x.ctx.uc.uc_stack.ss_size = STACK;
        x.ctx.uc.uc_link = nullptr;
        makecontext(&x.ctx.uc, reinterpret_cast<void (*)()>(&fiber_main), 0);
#endif
    }
    int next_after(int i) const {       // the next fiber not done, in the phase's order (i itself if it is the last)
        for (int k = 1; k <= n; k++) {
            const int j = reverse ? ((i - k) % n + n) % n : (i + k) % n;
            if (!f[j].done) return j;
        }
        return i;
    }
    void save(Fiber& x);
    void load(const Fiber& x);
    void pass() {                       // hand the OS thread to the next fiber; back here when it is our turn again
        const int from = cur, to = next_after(from);
        if (to == from) return;
        save(f[from]);
        cur = to;
        jump(f[from].ctx, f[to].ctx);
        load(f[cur]);
    }
    void run(int threads, std::function<void(int)> fn) {
        std::lock_guard<std::mutex> one(launch_mu);
        if ((int)f.size() < threads) f.resize(threads);
        for (int i = 0; i < threads; i++) start(f[i]);
        n = live = threads;
        stalls = 0;
        job = std::move(fn);
        cur = reverse ? threads - 1 : 0;
        jump(host, f[cur].ctx);                         // back when the last fiber is done
        job = nullptr;
    }
};
inline Fibers& fibers() {
    static Fibers* s = new Fibers();    // leaked on purpose: no destructor runs at exit while a launch is parked
    return *s;
}

inline thread_local int ltid = 0;       // linear thread id in the block
inline void Fibers::save(Fiber& x) { x.ltid = ltid; x.tid = threadIdx; x.bid = blockIdx; }
inline void Fibers::load(const Fiber& x) { ltid = x.ltid; threadIdx = x.tid; blockIdx = x.bid; }

inline void progress() { fibers().stalls = 0; }
[[noreturn]] inline void deadlock() {
    Fibers& s = fibers();
    std::fprintf(stderr, "cpusim: deadlock in block (%u, %u, %u): %d of %d threads wait at barriers, shuffles or "
                 "votes that the others never reach (a __syncthreads or a full-mask shuffle in divergent code?)\n",
                 blockIdx.x, blockIdx.y, blockIdx.z, s.live, s.n);
    std::abort();
}
template <class Pred> inline void wait_until(Pred ready) {      // poll, handing on between polls
    Fibers& s = fibers();
    while (!ready()) {
        if (++s.stalls > 2L * s.live + 2) deadlock();
        s.pass();
    }
    progress();
}

[[noreturn]] inline void fiber_main() {
    Fibers& s = fibers();
    s.job(s.cur);
    const int me = s.cur;
    s.f[me].done = true;
    progress();
    Context& to = --s.live == 0 ? s.host : s.f[s.cur = s.next_after(me)].ctx;
    jump(s.f[me].ctx, to);
    std::abort();                       // (never resumed: start() makes a new frame for the next launch)
}

// a barrier whose thread count drops when a thread exits (as exited threads stop counting on a GPU) and is set
// again for every block
struct DropBarrier {
    int expected = 0, arrived = 0;
    unsigned gen = 0;
    void (*on_complete)(void*) = nullptr;              // run by the last thread in, before any goes on
    void* arg = nullptr;
    void reset(int n) { expected = n; arrived = 0; }
    void complete() {
        arrived = 0;
        gen++;
        progress();
        if (on_complete) on_complete(arg);
    }
    void arrive_and_wait() {
        const unsigned g = gen;
        if (++arrived == expected) {    // the last one in goes on last: the next phase starts at the first thread
            complete();
            fibers().pass();
            return;
        }
        wait_until([&] { return gen != g; });
    }
    void drop() {
        --expected;
        if (arrived > 0 && arrived == expected) complete();
    }
};

struct Warp {
    DropBarrier bar;
    int size = 32;
    unsigned long long buf[2][32];
    int phase[32];
};
struct Block {
    DropBarrier bar;
    std::vector<Warp> warps;
    int n = 0;
    void reset() {
        bar.reset(n);
        for (auto& w : warps) { w.bar.reset(w.size); std::memset(w.phase, 0, sizeof(w.phase)); }
    }
};
inline Block* block = nullptr;          // the running block (one at a time)
inline unsigned char* dyn_smem = nullptr; // the launch's dynamic shared memory (DYN_SHARED)

inline Warp& warp() { return block->warps[ltid / 32]; }

template <class T> inline T exchange(T v, int src_lane_of_me_fn(int, int), int arg) {
    static_assert(sizeof(T) <= 8, "cpusim shuffles move at most 8 bytes");
    Warp& w = warp();
    const int lane = ltid % 32, ph = w.phase[lane];
    w.phase[lane] ^= 1;
    std::memcpy(&w.buf[ph][lane], &v, sizeof(T));
    w.bar.arrive_and_wait();
    const int src = src_lane_of_me_fn(lane, arg);
    T r;
    std::memcpy(&r, &w.buf[ph][src & 31], sizeof(T));
    return r;
}
inline int lane_xor(int lane, int o) { return lane ^ o; }
inline int lane_abs(int, int src) { return src; }
inline int lane_down(int lane, int d) { return lane + d < 32 ? lane + d : lane; }
inline int lane_up(int lane, int d) { return lane - d >= 0 ? lane - d : lane; }

// every block of the grid, one after another, on one set of blockDim fibers
inline void run_grid(dim3 g, dim3 b, void (*body)(void*), void* ctx, size_t smem = 0) {
    std::vector<float4> dyn((smem + 15) / 16 + 1);               // 16-byte aligned, poisoned with NaN
    std::memset(dyn.data(), 0xFF, dyn.size() * 16);
    dyn_smem = reinterpret_cast<unsigned char*>(dyn.data());
    const int n = (int)(b.x * b.y * b.z);
    if (n == 0 || n > 1024) {
        std::fprintf(stderr, "cpusim: block of %u x %u x %u threads (1 to 1024 allowed)\n", b.x, b.y, b.z);
        std::abort();
    }
    const unsigned long long blocks = (unsigned long long)g.x * g.y * g.z;
    Block blk;
    blk.n = n;
    const int nw = (n + 31) / 32;
    blk.warps = std::vector<Warp>(nw);
    for (int w = 0; w < nw; w++) blk.warps[w].size = std::min(32, n - 32 * w);
    blk.reset();
    block = &blk;
    DropBarrier done;                                              // every thread, every block: never dropped
    done.reset(n);
    done.on_complete = [](void* p) { static_cast<Block*>(p)->reset(); };   // the next block starts afresh
    done.arg = &blk;
    blockDim = b;
    gridDim = g;
    fibers().run(n, [&](int t) {
        ltid = t;
        threadIdx = uint3{(unsigned)(t % b.x), (unsigned)(t / b.x % b.y), (unsigned)(t / (b.x * b.y))};
        for (unsigned long long i = 0; i < blocks; i++) {
            blockIdx = uint3{(unsigned)(i % g.x), (unsigned)(i / g.x % g.y),
                             (unsigned)(i / ((unsigned long long)g.x * g.y))};
            body(ctx);
            blk.warps[t / 32].bar.drop();                          // an exited thread stops counting
            blk.bar.drop();
            done.arrive_and_wait();                                // the block is over: the next starts afresh
        }
    });
    block = nullptr;
}

template <class... P, class... A> void launch_smem(void (*k)(P...), dim3 g, dim3 b, size_t smem, A... a) {
    std::tuple<P...> args(static_cast<P>(a)...);
    struct Ctx { void (*k)(P...); std::tuple<P...>* args; } ctx{k, &args};
    run_grid(g, b, [](void* c) {
        auto* cx = static_cast<Ctx*>(c);
        std::apply(cx->k, *cx->args);
    }, &ctx, smem);
}
template <class... P, class... A> void launch(void (*k)(P...), dim3 g, dim3 b, A... a) {
    launch_smem(k, g, b, 0, a...);
}

}  // namespace cpusim

inline void __syncthreads() { cpusim::block->bar.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { cpusim::warp().bar.arrive_and_wait(); }
template <class T> inline T __shfl_xor_sync(unsigned, T v, int o, int = 32) {
    return cpusim::exchange(v, cpusim::lane_xor, o);
}
template <class T> inline T __shfl_sync(unsigned, T v, int src, int = 32) {
    return cpusim::exchange(v, cpusim::lane_abs, src);
}
template <class T> inline T __shfl_down_sync(unsigned, T v, unsigned d, int = 32) {
    return cpusim::exchange(v, cpusim::lane_down, (int)d);
}
template <class T> inline T __shfl_up_sync(unsigned, T v, unsigned d, int = 32) {
    return cpusim::exchange(v, cpusim::lane_up, (int)d);
}
inline unsigned __ballot_sync(unsigned, int pred) {           // one exchange: every lane reads all 32 votes
    cpusim::Warp& w = cpusim::warp();
    const int lane = cpusim::ltid % 32, ph = w.phase[lane];
    w.phase[lane] ^= 1;
    w.buf[ph][lane] = pred ? 1 : 0;
    w.bar.arrive_and_wait();
    unsigned bits = 0;
    for (int l = 0; l < w.size; l++)
        if (w.buf[ph][l]) bits |= 1u << l;
    return bits;
}
inline int __any_sync(unsigned m, int pred) { return __ballot_sync(m, pred) != 0; }
inline int __all_sync(unsigned m, int pred) {
    const int n = std::min(32, (int)(blockDim.x * blockDim.y * blockDim.z) - cpusim::ltid / 32 * 32);
    return __ballot_sync(m, pred) == (n == 32 ? 0xffffffffu : (1u << n) - 1u);
}
inline int __syncthreads_or(int pred) {                            // a block-wide vote through shared memory
    static std::atomic<int> any{0};
    __syncthreads();
    if (cpusim::ltid == 0) any.store(0);
    __syncthreads();
    if (pred) any.store(1);
    __syncthreads();
    int r = any.load();
    __syncthreads();
    return r;
}

#ifdef CPUSIM_HALF
// ---- fp16 / bf16 storage, tensor cores and cp.async on CPU threads (-DCPUSIM_HALF; common.cuh's HALF_TYPES) -----
// __half / __nv_bfloat16: 16 bits of storage, converted with round-to-nearest-even (float16 by the compiler's
// _Float16, IEEE; bfloat16 by the bit trick of csrc/mixed.cu). mma.sync m16n8k16: every lane posts its A and B
// fragments to the warp, one barrier, each lane assembles the rows and columns of its C fragment and accumulates
// them in float32, k ascending (a tensor core sums in its own order: rounding-level differences, never structural).
// cp.async: a plain 16-byte copy (zero-filled past src_bytes), so commit / wait have nothing to wait for.
namespace cpusim {
inline unsigned short f2bf(float x) {
    unsigned u = __float_as_uint(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (unsigned short)((u >> 16) | 0x40u);   // NaN: quiet, sign kept
    return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline float bf2f(unsigned short h) { return __uint_as_float((unsigned)h << 16); }
inline unsigned short f2h(float x) {
    _Float16 h = (_Float16)x;
    unsigned short b;
    std::memcpy(&b, &h, 2);
    return b;
}
inline float h2f(unsigned short b) {
    _Float16 h;
    std::memcpy(&h, &b, 2);
    return (float)h;
}
}  // namespace cpusim
struct __half {
    unsigned short x;
    __half() = default;
    __half(float f) : x(cpusim::f2h(f)) {}
    operator float() const { return cpusim::h2f(x); }
};
struct __nv_bfloat16 {
    unsigned short x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : x(cpusim::f2bf(f)) {}
    operator float() const { return cpusim::bf2f(x); }
};
struct __half2 { __half x, y; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline float __half2float(__half h) { return (float)h; }
inline float __bfloat162float(__nv_bfloat16 h) { return (float)h; }
inline __half __float2half_rn(float f) { return __half(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__half(a), __half(b)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return __nv_bfloat162{__nv_bfloat16(a), __nv_bfloat16(b)}; }

namespace cpusim {
struct MmaWarp { unsigned frag[2][32][6]; int phase[32]; };
inline MmaWarp& mma_warp() {                                     // one per warp of the running block
    static std::vector<MmaWarp> all;       // (one OS thread runs a launch's fibers: no lock; the first call
    const int w = ltid / 32;                // of a launch grows it, before any of its fibers holds an element)
    if ((int)all.size() < (int)block->warps.size()) all.resize(block->warps.size());
    return all[w];
}
template <class T> inline float frag_value(unsigned reg, int hi) {
    const unsigned short b = (unsigned short)(hi ? reg >> 16 : reg & 0xFFFFu);
    return std::is_same<T, __half>::value ? h2f(b) : bf2f(b);
}
template <class T> inline void mma16816(float* c, const unsigned* a, const unsigned* b) {
    MmaWarp& m = mma_warp();
    const int lane = ltid % 32, ph = m.phase[lane];
    m.phase[lane] ^= 1;
    std::memcpy(m.frag[ph][lane], a, 16);
    std::memcpy(m.frag[ph][lane] + 4, b, 8);
    warp().bar.arrive_and_wait();
    const int g = lane >> 2, t = lane & 3;
    for (int r = 0; r < 2; r++)
        for (int cc = 0; cc < 2; cc++) {
            const int row = g + 8 * r, col = 2 * t + cc;
            float acc = 0.f;
            for (int k = 0; k < 16; k++) {             // A[row][k] and B[k][col] from the lanes holding them
                const unsigned* fa = m.frag[ph][4 * (row & 7) + ((k & 7) >> 1)];
                const unsigned* fb = m.frag[ph][4 * col + ((k & 7) >> 1)];
                const float av = frag_value<T>(fa[(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k & 1);
                const float bv = frag_value<T>(fb[4 + (k >= 8 ? 1 : 0)], k & 1);
                acc += av * bv;
            }
            c[2 * r + cc] += acc;
        }
}
// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: lane L gives the address of row L % 8 of 8 x 8 matrix L / 8
// (16 bytes of 16-bit values); register i of lane L receives two values of matrix i: row L / 4, columns
// 2 (L % 4) and 2 (L % 4) + 1, or with .trans column L / 4, rows 2 (L % 4) and 2 (L % 4) + 1 (low half first)
struct LdsmWarp { const unsigned short* row[2][32]; int phase[32]; };
inline LdsmWarp& ldsm_warp() {                                   // one per warp of the running block
    static std::vector<LdsmWarp> all;      // (as mma_warp's)
    if ((int)all.size() < (int)block->warps.size()) all.resize(block->warps.size());
    return all[ltid / 32];
}
// what the hardware demands and a CPU would not notice: ldmatrix's row addresses and cp.async's two addresses
// 16-byte aligned (a misaligned one is a fault on the GPU: here it stops the program, naming the instruction)
inline void need_aligned16(const void* a, const char* what) {
    if (reinterpret_cast<std::uintptr_t>(a) % 16) {
        std::fprintf(stderr, "cpusim: %s address %p not 16-byte aligned (a misaligned-address fault on a GPU)\n",
                     what, a);
        std::abort();
    }
}
template <bool TRANS> inline void ldsm_x4(unsigned* r, const void* addr) {
    need_aligned16(addr, "ldmatrix row");
    LdsmWarp& m = ldsm_warp();
    const int lane = ltid % 32, ph = m.phase[lane];
    m.phase[lane] ^= 1;
    m.row[ph][lane] = static_cast<const unsigned short*>(addr);
    warp().bar.arrive_and_wait();
    const int g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; i++) {
        unsigned lo, hi;
        if (TRANS) {
            lo = m.row[ph][8 * i + 2 * t][g];
            hi = m.row[ph][8 * i + 2 * t + 1][g];
        } else {
            lo = m.row[ph][8 * i + g][2 * t];
            hi = m.row[ph][8 * i + g][2 * t + 1];
        }
        r[i] = lo | (hi << 16);
    }
}
inline void cp_async16(void* smem, const void* gmem, int src_bytes) {
    need_aligned16(smem, "cp.async shared");
    need_aligned16(gmem, "cp.async global");
    std::memset(smem, 0, 16);
    std::memcpy(smem, gmem, (size_t)std::min(src_bytes, 16));
}
}  // namespace cpusim
#endif  // CPUSIM_HALF

#define LAUNCH(k, grid, block, ...) cpusim::launch(k, dim3(grid), dim3(block), __VA_ARGS__)
#define LAUNCH_SMEM(k, grid, block, smem, ...) cpusim::launch_smem(k, dim3(grid), dim3(block), smem, __VA_ARGS__)
#define DYN_SHARED(T, name) T* name = reinterpret_cast<T*>(cpusim::dyn_smem)

// ---- host API of the standalone mains -------------------------------------------------------------------------
#if !defined(NO_MAIN)
typedef int cudaError_t;
enum { cudaSuccess = 0 };
enum cudaMemcpyKind { cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice };
inline const char* cudaGetErrorString(cudaError_t) { return "cpusim error"; }
template <class T> inline cudaError_t cudaMalloc(T** p, size_t n) {
    *p = static_cast<T*>(std::aligned_alloc(256, (n + 255) / 256 * 256));
    std::memset(*p, 0xFF, (n + 255) / 256 * 256);                  // poison: NaN floats, -1 integers
    return *p ? cudaSuccess : 1;
}
inline cudaError_t cudaFree(void* p) { std::free(p); return cudaSuccess; }
inline cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind) { std::memcpy(d, s, n); return 0; }
inline cudaError_t cudaMemset(void* d, int v, size_t n) { std::memset(d, v, n); return cudaSuccess; }
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
template <class F> inline cudaError_t cudaFuncSetAttribute(F, int, int) { return cudaSuccess; }
enum { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
typedef std::chrono::steady_clock::time_point* cudaEvent_t;
inline cudaError_t cudaEventCreate(cudaEvent_t* e) { *e = new std::chrono::steady_clock::time_point(); return 0; }
inline cudaError_t cudaEventRecord(cudaEvent_t e, int = 0) { *e = std::chrono::steady_clock::now(); return 0; }
inline cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
    *ms = std::chrono::duration<float, std::milli>(*b - *a).count();
    return cudaSuccess;
}
#endif

// ---- the entry point kernels/cuda/emulate.py calls through ctypes ---------------------------------------------
#ifdef CPUSIM_LIB
namespace cpusim {
struct TrampCtx { void (*tramp)(void**); void** args; };
}
extern "C" int cpusim_launch(void (*tramp)(void**), void** args, unsigned gx, unsigned gy, unsigned gz,
                             unsigned bx, unsigned by, unsigned bz, unsigned long long smem) {
    cpusim::TrampCtx ctx{tramp, args};
    cpusim::run_grid(dim3(gx, gy, gz), dim3(bx, by, bz), [](void* c) {
        auto* t = static_cast<cpusim::TrampCtx*>(c);
        t->tramp(t->args);
    }, &ctx, (size_t)smem);
    return 0;
}
#endif

#else   // nvcc / NVRTC

#define LAUNCH(k, grid, block, ...) k<<<grid, block>>>(__VA_ARGS__)
#define LAUNCH_SMEM(k, grid, block, smem, ...) k<<<grid, block, smem>>>(__VA_ARGS__)
#define DYN_SHARED(T, name) extern __shared__ __align__(16) unsigned char name##_raw[]; \
    T* name = reinterpret_cast<T*>(name##_raw)

#endif
