// Two-TU link test (built twice, host TU first and device TU first): a cuda:0 tensor made in either TU
// takes the CUDA path in both link orders. Without a GPU the allocation fails in the CUDA runtime; what
// must never appear is "compiled without CUDA" (the symptom of two TUs with different Tensor bodies).
#include <cstdio>
#include <string>

std::string make_cuda_tensor_in_host_tu();
std::string make_cuda_tensor_in_device_tu();
int host_tu_config();
int device_tu_config();

int main() {
  const std::string host = make_cuda_tensor_in_host_tu();
  const std::string device = make_cuda_tensor_in_device_tu();
  std::printf("DTENSOR_HAS_CUDA: host TU %d, device TU %d\nhost TU: %s\ndevice TU: %s\n", host_tu_config(),
              device_tu_config(), host.c_str(), device.c_str());
  const bool agree = host_tu_config() == 1 && device_tu_config() == 1;
  const bool cuda_path = host.find("compiled without CUDA") == std::string::npos &&
                         device.find("compiled without CUDA") == std::string::npos;
  const bool same = (host == "ok") == (device == "ok");
  if (!agree || !cuda_path || !same) {
    std::printf("FAIL: the two TUs disagree\n");
    return 1;
  }
  std::printf("PASS\n");
  return 0;
}
