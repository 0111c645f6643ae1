// cpusim: the CUDA C kernels of kernels/cuda/csrc/*.cu compiled by g++ and run on CPU threads, to prove their
// indexing, reductions, tails and barriers on a machine without a GPU (common.cuh includes this under -DCPUSIM).
//
//     g++ -std=c++20 -O1 -pthread -ffp-contract=off -DCPUSIM -DCPUSIM_SMALL -I csrc -x c++ layernorm.cu -o x && ./x
//
// Model of execution (what a kernel sees):
//   - a launch runs its blocks one after another on blockDim.x * y * z OS threads (a pool kept across launches),
//     each with its own threadIdx (thread_local), so `__shared__` (defined as `static`) is one array per kernel
//     shared by the running block's threads, as on a GPU;
//   - __syncthreads() is a std::barrier of the block, __syncwarp() and every warp shuffle / vote a barrier of the
//     thread's warp (32 consecutive linear thread ids); a thread that returns drops out of both (arrive_and_drop),
//     as exited threads stop counting on a GPU;
//   - shuffles exchange through a double-buffered per-warp buffer: one barrier per call, every lane of the warp must
//     call (a full-mask shuffle with an exited or diverged lane is undefined on a GPU too, and hangs here);
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
#include <barrier>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <pthread.h>
#include <memory>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

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

// a barrier whose thread count drops when a thread exits (as exited threads stop counting on a GPU) and is set
// again for every block
struct DropBarrier {                    // state = expected << 32 | arrived, one atomic word
    std::atomic<unsigned long long> state{0};
    std::atomic<unsigned> gen{0};
    static constexpr unsigned long long ONE = 1ull << 32, LOW = ONE - 1;
    void reset(int n) { state.store((unsigned long long)n << 32); }
    void complete() {                   // every expected thread is in: start the next phase, wake them
        unsigned long long s = state.load();
        while (!state.compare_exchange_weak(s, s & ~LOW)) {}
        gen.fetch_add(1);
        gen.notify_all();
    }
    void arrive_and_wait() {
        const unsigned g = gen.load();
        const unsigned long long s = state.fetch_add(1) + 1;
        if ((s & LOW) == (s >> 32)) { complete(); return; }
        for (int spin = 0; gen.load() == g; spin++) {
            if (spin < 64) std::this_thread::yield();
            else gen.wait(g);
        }
    }
    void drop() {
        const unsigned long long s = state.fetch_sub(ONE) - ONE;
        if ((s & LOW) > 0 && (s & LOW) == (s >> 32)) complete();
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
inline thread_local int ltid = 0;       // linear thread id in the block

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

// The OS threads that play a launch's CUDA threads, kept from one launch to the next: making and joining 256
// std::threads took about 11 ms a launch on 2 cores (a launch of 256 threads doing nothing: 11.5 ms, now 0.57),
// most of an emulated step's time. Worker t runs thread t of every launch with at least t + 1 threads; run() hands
// the job to the first n (they wait on a generation count, C++20 atomic wait: no lock to queue on) and waits until
// all n are done. Launches run one at a time (a mutex: the globals below are the running launch's). Leaked on
// purpose (never destroyed, its threads detached): a process exits with them parked, no destructor joins them.
struct Pool {
    std::mutex launch_mu;
    int workers = 0;                                        // made so far (under launch_mu)
    std::atomic<unsigned long long> gen{0};                 // bumped once a launch: the workers wait on it
    std::atomic<int> want{0}, remaining{0};
    std::function<void(int)> job;                           // written before gen is bumped, read after
    void loop(int id) {
        unsigned long long seen = 0;
        for (;;) {
            unsigned long long g;
            while ((g = gen.load(std::memory_order_acquire)) == seen) gen.wait(seen);
            seen = g;
            if (id >= want.load(std::memory_order_acquire)) continue;    // not in this launch
            job(id);
            if (remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) remaining.notify_one();
        }
    }
    void run(int n, std::function<void(int)> fn) {
        std::lock_guard<std::mutex> one(launch_mu);
        for (; workers < n; workers++) std::thread([this, id = workers] { loop(id); }).detach();
        job = std::move(fn);
        want.store(n, std::memory_order_release);
        remaining.store(n, std::memory_order_release);
        gen.fetch_add(1, std::memory_order_acq_rel);
        gen.notify_all();
        for (int r; (r = remaining.load(std::memory_order_acquire)) != 0;) remaining.wait(r);
        job = nullptr;
    }
};
inline Pool*& pool_ptr() {
    static Pool* p = new Pool();
    return p;
}
inline Pool& pool() {                   // (a child forked from a process with workers has none: it starts anew)
    static const int once = pthread_atfork(nullptr, nullptr, [] { pool_ptr() = new Pool(); });
    (void)once;
    return *pool_ptr();
}

// every block of the grid, one after another, on one set of blockDim threads (the pool's first blockDim)
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
    auto next_block = [&blk]() noexcept { blk.reset(); };         // by the last thread in, before any goes on
    std::barrier done(n, next_block);                              // every thread, every block: never dropped
    pool().run(n, [&](int t) {
        ltid = t;
        threadIdx = uint3{(unsigned)(t % b.x), (unsigned)(t / b.x % b.y), (unsigned)(t / (b.x * b.y))};
        blockDim = b;
        gridDim = g;
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
    static std::vector<MmaWarp> all;
    static std::mutex mu;
    const int w = ltid / 32;
    std::lock_guard<std::mutex> lock(mu);
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
    static std::vector<LdsmWarp> all;
    static std::mutex mu;
    std::lock_guard<std::mutex> lock(mu);
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
