// What qfuse's CUDA decode kernels share (prepended to each kernel's source before NVRTC compiles it):
// 16-byte vectors, the streaming load of a weight that is read once, the float <-> half conversions of an
// epilogue by dtype code, and the pair selections of `prmt`.
//
// Dtype codes of the -D options (the Python launchers' `DTYPE_CODES`): 0 none, 1 float32, 2 bf16, 3 fp16.

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

// `__launch_bounds__`' minimum of blocks a multiprocessor for about `warps` resident warps (65536 / (32 warps)
// registers a thread), at least 1; WARPS is the kernel's warps a block
#define MIN_BLOCKS_FOR(warps) ((warps) / WARPS > 0 ? (warps) / WARPS : 1)

// Programmatic dependent launch (Hopper on): a kernel launched with it may start while the kernel before it in the
// stream ends; it waits here before it reads what that kernel wrote or writes what it reads. Without it (or before
// sm_90) both are no-ops.
__device__ __forceinline__ void wait_for_the_previous_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void let_the_next_kernel_start() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

struct __align__(16) Words { unsigned x, y, z, w; };  // 16 bytes: one vector load
struct __align__(8) Pair { unsigned x, y; };          // 8 bytes

__device__ __forceinline__ float bits_as_float(unsigned bits) {
    float f;
    asm("mov.b32 %0, %1;" : "=f"(f) : "r"(bits));
    return f;
}

__device__ __forceinline__ Words load_streaming(const Words* p) {  // read once: not kept in L1
    Words v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ unsigned select_bytes(unsigned a, unsigned b, unsigned selector) {  // prmt
    unsigned r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
    return r;
}

__device__ __forceinline__ unsigned low_pair(unsigned v) { return select_bytes(v, v, 0x1010); }   // (lo, lo)
__device__ __forceinline__ unsigned high_pair(unsigned v) { return select_bytes(v, v, 0x3232); }  // (hi, hi)

// element i of a float32 / bf16 / fp16 array, as float
template <int CODE>
__device__ __forceinline__ float load_as_float(const void* p, long long i) {
    if (CODE == 1) return reinterpret_cast<const float*>(p)[i];
    const unsigned short h = reinterpret_cast<const unsigned short*>(p)[i];
    if (CODE == 2) return bits_as_float(((unsigned)h) << 16);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// v rounded once (to nearest even) into element i of a float32 / bf16 / fp16 array
template <int CODE>
__device__ __forceinline__ void store_from_float(void* p, long long i, float v) {
    unsigned short h;
    if (CODE == 1) {
        reinterpret_cast<float*>(p)[i] = v;
        return;
    }
    if (CODE == 2) asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    else asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    reinterpret_cast<unsigned short*>(p)[i] = h;
}
