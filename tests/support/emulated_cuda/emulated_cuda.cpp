// The emulated CUDA runtime and cuBLAS (see emulated_cuda.hpp for what emulation proves and what not).
// Every entry point validates its handles and pointers as CUDA documents, then runs at once on the calling
// thread under one lock (the device executes one thing at a time).

#include "emulated_cuda.hpp"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <set>
#include <type_traits>
#include <vector>

#include "dtensor/core/element_type.hpp"

// The opaque handles of the CUDA headers, defined here.
struct CUstream_st {
  int device;
};
struct CUevent_st {
  int device;
};
struct cublasContext {
  cudaStream_t stream;
};

namespace dtensor::emulated_cuda {
namespace {

constexpr int kDevices = 1;
constexpr std::size_t kAlignment = 256; // cudaMalloc's

struct Allocation {
  char* span;        // first page
  std::size_t pages; // bytes of its pages (the guard page after them not included)
  std::size_t size;  // bytes asked for; the allocation is [base, base + size), base = key
  int open = 0;      // > 0: readable and writable now
};

/// The device: its memory (the arena), handles, counters. Guarded by `mutex`.
struct Device {
  std::recursive_mutex mutex;
  char* arena = nullptr;
  std::size_t arena_size = 0;
  std::size_t used = 0;
  std::size_t page = 4096;
  std::map<std::uintptr_t, Allocation> live; // by base address
  std::set<const CUstream_st*> streams;
  std::set<const CUevent_st*> events;
  std::set<const cublasContext*> handles;
  Counters counters;

  Device() {
    page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    // Address space only (PROT_NONE, no reserve): pages become memory when an allocation is opened and
    // written, and go back to the system when it is freed.
    for (std::size_t gib : {1024, 256, 64, 16}) {
      const std::size_t bytes = gib << 30;
      void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p != MAP_FAILED) {
        arena = static_cast<char*>(p);
        arena_size = bytes;
        break;
      }
    }
    if (arena == nullptr) {
      std::fprintf(stderr, "emulated CUDA: cannot reserve address space for device memory\n");
      std::abort();
    }
  }

  bool in_arena(const void* p) const {
    const auto* c = static_cast<const char*>(p);
    return c >= arena && c < arena + arena_size;
  }

  /// The live allocation holding [p, p + n) (n > 0), or nullptr.
  Allocation* find(const void* p, std::size_t n) {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    auto it = live.upper_bound(a);
    if (it == live.begin()) {
      return nullptr;
    }
    --it;
    const std::uintptr_t base = it->first;
    if (a < base || a - base > it->second.size || n > it->second.size - (a - base)) {
      return nullptr;
    }
    return &it->second;
  }

  void protect(Allocation& al, int prot) {
    if (mprotect(al.span, al.pages, prot) != 0) {
      std::perror("emulated CUDA: mprotect");
      std::abort();
    }
  }
  void open(Allocation& al) {
    if (al.open++ == 0) {
      protect(al, PROT_READ | PROT_WRITE);
    }
  }
  void close(Allocation& al) {
    if (--al.open == 0) {
      protect(al, PROT_NONE);
    }
  }
};

Device& device() {
  static Device* d = new Device; // never destroyed: deleters may free device memory at exit
  return *d;
}

thread_local int current_device = 0;
thread_local cudaError_t last_error = cudaSuccess;

cudaError_t result(cudaError_t e) {
  if (e != cudaSuccess) {
    last_error = e;
  }
  return e;
}

bool valid_stream(const Device& d, cudaStream_t s) {
  return s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread || d.streams.count(s) != 0;
}

/// Where a pointer range is: host memory (outside the arena), inside one live allocation, or neither.
enum class Where { host, device, invalid };

Where where(Device& d, const void* p, std::size_t n, Allocation** al) {
  *al = nullptr;
  if (!d.in_arena(p)) {
    return d.in_arena(static_cast<const char*>(p) + (n > 0 ? n - 1 : 0)) ? Where::invalid : Where::host;
  }
  *al = d.find(p, n > 0 ? n : 1);
  return *al != nullptr ? Where::device : Where::invalid;
}

/// Opens the allocations of a call for its lifetime (each at most once).
class Access {
public:
  explicit Access(Device& d) : d_(d) {}
  void add(Allocation* al) {
    if (al != nullptr && std::find(open_.begin(), open_.end(), al) == open_.end()) {
      d_.open(*al);
      open_.push_back(al);
    }
  }
  void add_all() {
    for (auto& [base, al] : d_.live) {
      add(&al);
    }
  }
  ~Access() {
    for (Allocation* al : open_) {
      d_.close(*al);
    }
  }
  Access(const Access&) = delete;
  Access& operator=(const Access&) = delete;

private:
  Device& d_;
  std::vector<Allocation*> open_;
};

/// Checks a copy's two ranges (dst_n bytes at dst, src_n at src) against its kind; on success both are
/// open in `access`.
cudaError_t check_copy(Device& d, Access& access, void* dst, std::size_t dst_n, const void* src,
                       std::size_t src_n, cudaMemcpyKind kind) {
  Allocation* da = nullptr;
  Allocation* sa = nullptr;
  const Where dw = where(d, dst, dst_n, &da);
  const Where sw = where(d, src, src_n, &sa);
  if (dw == Where::invalid || sw == Where::invalid) {
    return cudaErrorInvalidValue;
  }
  const bool ok = kind == cudaMemcpyDefault ||
                  (kind == cudaMemcpyHostToDevice && sw == Where::host && dw == Where::device) ||
                  (kind == cudaMemcpyDeviceToHost && sw == Where::device && dw == Where::host) ||
                  (kind == cudaMemcpyDeviceToDevice && sw == Where::device && dw == Where::device) ||
                  (kind == cudaMemcpyHostToHost && sw == Where::host && dw == Where::host);
  if (!ok) {
    return cudaErrorInvalidMemcpyDirection;
  }
  access.add(da);
  access.add(sa);
  return cudaSuccess;
}

cudaError_t copy_2d(void* dst, std::size_t dpitch, const void* src, std::size_t spitch, std::size_t width,
                    std::size_t height, cudaMemcpyKind kind, cudaStream_t stream) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  if (!valid_stream(d, stream)) {
    return cudaErrorInvalidResourceHandle;
  }
  if (width > dpitch || width > spitch) {
    return cudaErrorInvalidPitchValue;
  }
  if (width == 0 || height == 0) {
    return cudaSuccess;
  }
  Access access(d);
  const cudaError_t e =
      check_copy(d, access, dst, (height - 1) * dpitch + width, src, (height - 1) * spitch + width, kind);
  if (e != cudaSuccess) {
    return e;
  }
  for (std::size_t r = 0; r < height; ++r) {
    std::memmove(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch, width);
  }
  ++d.counters.copies;
  return cudaSuccess;
}

} // namespace

Counters counters() {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  return d.counters;
}

bool is_device_pointer(const void* p) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  return d.find(p, 1) != nullptr;
}

} // namespace dtensor::emulated_cuda

using namespace dtensor::emulated_cuda;

extern "C" {

// ---- errors, devices, versions --------------------------------------------------------------------------

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
  case cudaSuccess:
    return "cudaSuccess";
  case cudaErrorInvalidValue:
    return "cudaErrorInvalidValue";
  case cudaErrorMemoryAllocation:
    return "cudaErrorMemoryAllocation";
  case cudaErrorInvalidDevice:
    return "cudaErrorInvalidDevice";
  case cudaErrorInvalidPitchValue:
    return "cudaErrorInvalidPitchValue";
  case cudaErrorInvalidMemcpyDirection:
    return "cudaErrorInvalidMemcpyDirection";
  case cudaErrorInvalidResourceHandle:
    return "cudaErrorInvalidResourceHandle";
  case cudaErrorNoDevice:
    return "cudaErrorNoDevice";
  case cudaErrorInsufficientDriver:
    return "cudaErrorInsufficientDriver";
  case cudaErrorNotSupported:
    return "cudaErrorNotSupported";
  default:
    return "cudaErrorUnknown";
  }
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
  case cudaSuccess:
    return "no error";
  case cudaErrorInvalidValue:
    return "invalid argument";
  case cudaErrorMemoryAllocation:
    return "out of memory";
  case cudaErrorInvalidDevice:
    return "invalid device ordinal";
  case cudaErrorInvalidPitchValue:
    return "invalid pitch argument";
  case cudaErrorInvalidMemcpyDirection:
    return "invalid copy direction for memcpy";
  case cudaErrorInvalidResourceHandle:
    return "invalid resource handle";
  default:
    return "emulated CUDA: an error this emulation does not describe";
  }
}

cudaError_t cudaGetLastError(void) {
  const cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) {
  return last_error;
}

cudaError_t cudaGetDeviceCount(int* count) {
  *count = kDevices;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* d) {
  *d = current_device;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int d) {
  if (d < 0 || d >= kDevices) {
    return result(cudaErrorInvalidDevice);
  }
  current_device = d;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  ++d.counters.device_syncs;
  return cudaSuccess;
}

// ---- streams and events ---------------------------------------------------------------------------------

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  *s = new CUstream_st{current_device};
  d.streams.insert(*s);
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* s) {
  return cudaStreamCreateWithFlags(s, 0);
}

cudaError_t cudaStreamDestroy(cudaStream_t s) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  if (s == nullptr || d.streams.erase(s) == 0) {
    return result(cudaErrorInvalidResourceHandle);
  }
  delete s;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  if (!valid_stream(d, s)) {
    return result(cudaErrorInvalidResourceHandle);
  }
  ++d.counters.stream_syncs;
  return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t s) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  return valid_stream(d, s) ? cudaSuccess : result(cudaErrorInvalidResourceHandle);
}

cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  *status = cudaStreamCaptureStatusNone;
  return valid_stream(d, s) ? cudaSuccess : result(cudaErrorInvalidResourceHandle);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  *e = new CUevent_st{current_device};
  d.events.insert(*e);
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* e) {
  return cudaEventCreateWithFlags(e, 0);
}

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  if (d.events.erase(e) == 0) {
    return result(cudaErrorInvalidResourceHandle);
  }
  delete e;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  return d.events.count(e) != 0 && valid_stream(d, s) ? cudaSuccess : result(cudaErrorInvalidResourceHandle);
}

cudaError_t cudaEventQuery(cudaEvent_t e) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  return d.events.count(e) != 0 ? cudaSuccess : result(cudaErrorInvalidResourceHandle);
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  if (d.events.count(e) == 0) {
    return result(cudaErrorInvalidResourceHandle);
  }
  ++d.counters.stream_syncs;
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  return d.events.count(e) != 0 && valid_stream(d, s) ? cudaSuccess : result(cudaErrorInvalidResourceHandle);
}

// ---- memory ---------------------------------------------------------------------------------------------

cudaError_t cudaMallocAsync(void** p, std::size_t size, cudaStream_t s) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  if (!valid_stream(d, s)) {
    return result(cudaErrorInvalidResourceHandle);
  }
  *p = nullptr;
  if (size == 0) {
    return cudaSuccess;
  }
  const std::size_t rounded = (size + kAlignment - 1) / kAlignment * kAlignment;
  const std::size_t pages = (rounded + d.page - 1) / d.page * d.page;
  if (pages + d.page > d.arena_size - d.used) {
    return result(cudaErrorMemoryAllocation);
  }
  char* span = d.arena + d.used;
  d.used += pages + d.page; // and a guard page, never opened
  char* base = span + pages - rounded;
  Allocation& al =
      d.live.emplace(reinterpret_cast<std::uintptr_t>(base), Allocation{span, pages, size}).first->second;
  // Fresh device memory holds garbage, not zeros: 0xff bytes (NaN in every floating type, -1 in the
  // signed ones), so a kernel that leaves an output element unwritten shows.
  d.open(al);
  std::memset(base, 0xff, size);
  d.close(al);
  ++d.counters.allocations;
  d.counters.live_bytes += static_cast<std::int64_t>(size);
  *p = base;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** p, std::size_t size) {
  return cudaMallocAsync(p, size, nullptr);
}

cudaError_t cudaFreeAsync(void* p, cudaStream_t s) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  if (!valid_stream(d, s)) {
    return result(cudaErrorInvalidResourceHandle);
  }
  if (p == nullptr) {
    return cudaSuccess;
  }
  const auto it = d.live.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == d.live.end() || it->second.open != 0) { // not an allocation's start, freed, or in use
    return result(cudaErrorInvalidValue);
  }
  // The pages go back to the system and stay PROT_NONE: never handed out again, so a late access faults.
  (void)madvise(it->second.span, it->second.pages, MADV_DONTNEED);
  d.counters.live_bytes -= static_cast<std::int64_t>(it->second.size);
  d.live.erase(it);
  return cudaSuccess;
}

cudaError_t cudaFree(void* p) {
  return cudaFreeAsync(p, nullptr);
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  *a = cudaPointerAttributes{};
  if (d.find(p, 1) != nullptr) {
    a->type = cudaMemoryTypeDevice;
    a->device = 0;
    a->devicePointer = const_cast<void*>(p);
  } else {
    a->type = cudaMemoryTypeUnregistered;
    a->device = -2;
    a->hostPointer = const_cast<void*>(p);
  }
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t n, cudaMemcpyKind kind, cudaStream_t s) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  if (!valid_stream(d, s)) {
    return result(cudaErrorInvalidResourceHandle);
  }
  if (n == 0) {
    return cudaSuccess;
  }
  Access access(d);
  const cudaError_t e = check_copy(d, access, dst, n, src, n, kind);
  if (e != cudaSuccess) {
    return result(e);
  }
  std::memmove(dst, src, n);
  ++d.counters.copies;
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t n, cudaMemcpyKind kind) {
  const cudaError_t e = cudaMemcpyAsync(dst, src, n, kind, nullptr);
  if (e == cudaSuccess) {
    Device& d = device();
    std::lock_guard lock(d.mutex);
    ++d.counters.device_syncs; // cudaMemcpy waits for the legacy default stream
  }
  return e;
}

cudaError_t cudaMemcpy2DAsync(void* dst, std::size_t dpitch, const void* src, std::size_t spitch,
                              std::size_t width, std::size_t height, cudaMemcpyKind kind, cudaStream_t s) {
  return result(copy_2d(dst, dpitch, src, spitch, width, height, kind, s));
}

cudaError_t cudaMemsetAsync(void* p, int value, std::size_t n, cudaStream_t s) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  if (!valid_stream(d, s)) {
    return result(cudaErrorInvalidResourceHandle);
  }
  if (n == 0) {
    return cudaSuccess;
  }
  Allocation* al = d.find(p, n);
  if (al == nullptr) {
    return result(cudaErrorInvalidValue);
  }
  Access access(d);
  access.add(al);
  std::memset(p, value, n);
  ++d.counters.memsets;
  return cudaSuccess;
}

cudaError_t cudaMemset(void* p, int value, std::size_t n) {
  return cudaMemsetAsync(p, value, n, nullptr);
}

// ---- launches -------------------------------------------------------------------------------------------

/// `func` is a host function void(void** args) (local/copy.hpp's emulated_kernel<F>), run now with every
/// live allocation open.
cudaError_t cudaLaunchKernel(const void* func, dim3, dim3, void** args, std::size_t, cudaStream_t s) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  if (!valid_stream(d, s)) {
    return result(cudaErrorInvalidResourceHandle);
  }
  if (func == nullptr) {
    return result(cudaErrorInvalidDeviceFunction);
  }
  Access access(d);
  access.add_all();
  reinterpret_cast<void (*)(void**)>(const_cast<void*>(func))(args);
  ++d.counters.kernels;
  return cudaSuccess;
}

cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void* data) {
  {
    Device& d = device();
    std::lock_guard lock(d.mutex);
    if (!valid_stream(d, s)) {
      return result(cudaErrorInvalidResourceHandle);
    }
  }
  fn(data); // a host function: device memory stays closed
  return cudaSuccess;
}

// ---- cuBLAS ---------------------------------------------------------------------------------------------

cublasStatus_t cublasCreate_v2(cublasHandle_t* h) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  *h = new cublasContext{nullptr};
  d.handles.insert(*h);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t h) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  if (d.handles.erase(h) == 0) {
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t s) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  if (d.handles.count(h) == 0) {
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  if (!valid_stream(d, s)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  h->stream = s;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream_v2(cublasHandle_t h, cudaStream_t* s) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  if (d.handles.count(h) == 0) {
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  *s = h->stream;
  return CUBLAS_STATUS_SUCCESS;
}

const char* cublasGetStatusName(cublasStatus_t s) {
  switch (s) {
  case CUBLAS_STATUS_SUCCESS:
    return "CUBLAS_STATUS_SUCCESS";
  case CUBLAS_STATUS_NOT_INITIALIZED:
    return "CUBLAS_STATUS_NOT_INITIALIZED";
  case CUBLAS_STATUS_INVALID_VALUE:
    return "CUBLAS_STATUS_INVALID_VALUE";
  case CUBLAS_STATUS_NOT_SUPPORTED:
    return "CUBLAS_STATUS_NOT_SUPPORTED";
  default:
    return "CUBLAS_STATUS_INTERNAL_ERROR";
  }
}

const char* cublasGetStatusString(cublasStatus_t s) {
  switch (s) {
  case CUBLAS_STATUS_SUCCESS:
    return "success";
  case CUBLAS_STATUS_NOT_INITIALIZED:
    return "the library was not initialized";
  case CUBLAS_STATUS_INVALID_VALUE:
    return "an invalid numeric value was used as an argument";
  case CUBLAS_STATUS_NOT_SUPPORTED:
    return "the functionality requested is not supported";
  default:
    return "emulated cuBLAS: an error this emulation does not describe";
  }
}

} // extern "C"

namespace dtensor::emulated_cuda {
namespace {

/// One column-major GEMM: C = alpha op(A) op(B) + beta C, m x n x k, elements of type E, accumulated in
/// Acc (float for CUBLAS_COMPUTE_32F, double for 64F). beta == 0: C is not read (cuBLAS's rule).
template <class E, class Acc>
void gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, Acc alpha, const E* a, int lda,
          const E* b, int ldb, Acc beta, E* c, int ldc) {
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < m; ++i) {
      Acc acc = 0;
      for (int l = 0; l < k; ++l) {
        const E x = ta == CUBLAS_OP_N ? a[i + static_cast<std::int64_t>(l) * lda]
                                      : a[l + static_cast<std::int64_t>(i) * lda];
        const E y = tb == CUBLAS_OP_N ? b[l + static_cast<std::int64_t>(j) * ldb]
                                      : b[j + static_cast<std::int64_t>(l) * ldb];
        acc += static_cast<Acc>(static_cast<float>(x)) * static_cast<Acc>(static_cast<float>(y));
      }
      E& out = c[i + static_cast<std::int64_t>(j) * ldc];
      const Acc prior = beta == Acc(0) ? Acc(0) : beta * static_cast<Acc>(static_cast<float>(out));
      out = E(k == 0 ? prior : alpha * acc + prior); // k = 0: C = beta C (a -0 stays -0), as BLAS
    }
  }
}
template <>
void gemm<double, double>(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, double alpha,
                          const double* a, int lda, const double* b, int ldb, double beta, double* c,
                          int ldc) {
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < m; ++i) {
      double acc = 0;
      for (int l = 0; l < k; ++l) {
        acc += (ta == CUBLAS_OP_N ? a[i + static_cast<std::int64_t>(l) * lda]
                                  : a[l + static_cast<std::int64_t>(i) * lda]) *
               (tb == CUBLAS_OP_N ? b[l + static_cast<std::int64_t>(j) * ldb]
                                  : b[j + static_cast<std::int64_t>(l) * ldb]);
      }
      double& out = c[i + static_cast<std::int64_t>(j) * ldc];
      const double prior = beta == 0 ? 0 : beta * out;
      out = k == 0 ? prior : alpha * acc + prior;
    }
  }
}

std::size_t element_size(cudaDataType_t t) {
  switch (t) {
  case CUDA_R_32F:
    return 4;
  case CUDA_R_64F:
    return 8;
  case CUDA_R_16BF:
  case CUDA_R_16F:
    return 2;
  default:
    return 0;
  }
}

/// One GEMM's checks and run, the lock held. The operands must lie in live allocations over the extents
/// their leading dimensions give (cuBLAS reads there); alpha and beta are host pointers.
cublasStatus_t run_gemm(Device& d, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                        const void* alpha, const void* a, int lda, const void* b, int ldb, const void* beta,
                        void* c, int ldc, cudaDataType_t type, cublasComputeType_t compute) {
  const bool ops_ok = (ta == CUBLAS_OP_N || ta == CUBLAS_OP_T) && (tb == CUBLAS_OP_N || tb == CUBLAS_OP_T);
  const int a_rows = ta == CUBLAS_OP_N ? m : k;
  const int b_rows = tb == CUBLAS_OP_N ? k : n;
  if (!ops_ok || m < 0 || n < 0 || k < 0 || lda < std::max(1, a_rows) || ldb < std::max(1, b_rows) ||
      ldc < std::max(1, m)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const std::size_t es = element_size(type);
  const bool dbl = type == CUDA_R_64F;
  if (es == 0 || compute != (dbl ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (m == 0 || n == 0) {
    return CUBLAS_STATUS_SUCCESS;
  }
  const int a_cols = ta == CUBLAS_OP_N ? k : m;
  const int b_cols = tb == CUBLAS_OP_N ? n : k;
  const auto extent = [es](int rows, int cols, int ld) {
    return (static_cast<std::size_t>(cols - 1) * static_cast<std::size_t>(ld) +
            static_cast<std::size_t>(rows)) *
           es;
  };
  Access access(d);
  Allocation* al = nullptr;
  if (where(d, c, extent(m, n, ldc), &al) != Where::device) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  access.add(al);
  if (k > 0) {
    if (where(d, a, extent(a_rows, a_cols, lda), &al) != Where::device) {
      return CUBLAS_STATUS_INVALID_VALUE;
    }
    access.add(al);
    if (where(d, b, extent(b_rows, b_cols, ldb), &al) != Where::device) {
      return CUBLAS_STATUS_INVALID_VALUE;
    }
    access.add(al);
  }
  if (dbl) {
    gemm<double, double>(ta, tb, m, n, k, *static_cast<const double*>(alpha), static_cast<const double*>(a),
                         lda, static_cast<const double*>(b), ldb, *static_cast<const double*>(beta),
                         static_cast<double*>(c), ldc);
  } else {
    const float al_f = *static_cast<const float*>(alpha);
    const float be_f = *static_cast<const float*>(beta);
    switch (type) {
    case CUDA_R_32F:
      gemm<float, float>(ta, tb, m, n, k, al_f, static_cast<const float*>(a), lda,
                         static_cast<const float*>(b), ldb, be_f, static_cast<float*>(c), ldc);
      break;
    case CUDA_R_16BF:
      gemm<dtensor::bfloat16, float>(ta, tb, m, n, k, al_f, static_cast<const dtensor::bfloat16*>(a), lda,
                                     static_cast<const dtensor::bfloat16*>(b), ldb, be_f,
                                     static_cast<dtensor::bfloat16*>(c), ldc);
      break;
    default:
      gemm<dtensor::half, float>(ta, tb, m, n, k, al_f, static_cast<const dtensor::half*>(a), lda,
                                 static_cast<const dtensor::half*>(b), ldb, be_f,
                                 static_cast<dtensor::half*>(c), ldc);
      break;
    }
  }
  ++d.counters.gemms;
  return CUBLAS_STATUS_SUCCESS;
}

bool valid_handle(Device& d, cublasHandle_t h) {
  return d.handles.count(h) != 0 && valid_stream(d, h->stream);
}

} // namespace
} // namespace dtensor::emulated_cuda

extern "C" {

cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void* alpha, const void* a, cudaDataType at, int lda, const void* b,
                            cudaDataType bt, int ldb, const void* beta, void* c, cudaDataType ct, int ldc,
                            cublasComputeType_t compute, cublasGemmAlgo_t) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  if (!valid_handle(d, h)) {
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  if (at != bt || at != ct) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  return run_gemm(d, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, at, compute);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                                          int n, int k, const void* alpha, const void* a, cudaDataType at,
                                          int lda, long long sa, const void* b, cudaDataType bt, int ldb,
                                          long long sb, const void* beta, void* c, cudaDataType ct, int ldc,
                                          long long sc, int batch, cublasComputeType_t compute,
                                          cublasGemmAlgo_t) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  if (!valid_handle(d, h)) {
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  if (at != bt || at != ct) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (batch < 0) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const auto es = static_cast<long long>(element_size(at));
  for (int i = 0; i < batch; ++i) {
    const cublasStatus_t s = run_gemm(d, ta, tb, m, n, k, alpha, static_cast<const char*>(a) + i * sa * es,
                                      lda, static_cast<const char*>(b) + i * sb * es, ldb, beta,
                                      static_cast<char*>(c) + i * sc * es, ldc, at, compute);
    if (s != CUBLAS_STATUS_SUCCESS) {
      return s;
    }
  }
  return CUBLAS_STATUS_SUCCESS;
}

/// The pointer arrays are device memory (cuBLAS reads them on the GPU): they must lie in live allocations.
/// alpha_array and beta_array are host arrays of float (CUBLAS_COMPUTE_32F), one per group.
cublasStatus_t cublasGemmGroupedBatchedEx(cublasHandle_t h, const cublasOperation_t ta[],
                                          const cublasOperation_t tb[], const int m[], const int n[],
                                          const int k[], const void* alpha, const void* const a[],
                                          cudaDataType_t at, const int lda[], const void* const b[],
                                          cudaDataType_t bt, const int ldb[], const void* beta,
                                          void* const c[], cudaDataType_t ct, const int ldc[], int groups,
                                          const int group_size[], cublasComputeType_t compute) {
  Device& d = device();
  std::lock_guard lock(d.mutex);
  if (!valid_handle(d, h)) {
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  if (at != bt || at != ct || at == CUDA_R_64F || compute != CUBLAS_COMPUTE_32F) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (groups < 0) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  std::size_t total = 0;
  for (int g = 0; g < groups; ++g) {
    if (group_size[g] < 0) {
      return CUBLAS_STATUS_INVALID_VALUE;
    }
    total += static_cast<std::size_t>(group_size[g]);
  }
  if (total == 0) {
    return CUBLAS_STATUS_SUCCESS;
  }
  const std::size_t bytes = total * sizeof(void*);
  Access access(d);
  Allocation* al = nullptr;
  for (const void* array :
       {static_cast<const void*>(a), static_cast<const void*>(b), static_cast<const void*>(c)}) {
    if (where(d, array, bytes, &al) != Where::device) {
      return CUBLAS_STATUS_INVALID_VALUE;
    }
    access.add(al);
  }
  const auto* alphas = static_cast<const float*>(alpha);
  const auto* betas = static_cast<const float*>(beta);
  std::size_t at_index = 0;
  for (int g = 0; g < groups; ++g) {
    for (int i = 0; i < group_size[g]; ++i, ++at_index) {
      const cublasStatus_t s = run_gemm(d, ta[g], tb[g], m[g], n[g], k[g], &alphas[g], a[at_index], lda[g],
                                        b[at_index], ldb[g], &betas[g], c[at_index], ldc[g], at, compute);
      if (s != CUBLAS_STATUS_SUCCESS) {
        return s;
      }
    }
  }
  return CUBLAS_STATUS_SUCCESS;
}

} // extern "C"
