// Page copies between KV tier entries and the device pools on the CPU.
//
// An entry (a flat uint8 blob) holds one full page of every full-attention
// layer, tensor after tensor: for tensor j, page_size rows of row_bytes[j]
// bytes, which in the pool are rows [page * page_size, (page + 1) *
// page_size) of tensor j. One call moves many pages, each segment one memcpy:
// the restore path costs one pass over the bytes, not a gather and a scatter.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

namespace {

std::vector<int64_t> page_bytes(const std::vector<at::Tensor>& pool, int64_t page_size) {
  std::vector<int64_t> out;
  for (const auto& t : pool) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "pool tensors must be contiguous CPU tensors");
    out.push_back(page_size * (t.dim() ? t.stride(0) : 1) * t.element_size());
  }
  return out;
}

}  // namespace

// blobs[i] -> page pages[i] of every pool tensor.
void blobs_to_pages(const std::vector<at::Tensor>& blobs, const std::vector<at::Tensor>& pool,
                    const at::Tensor& pages, int64_t page_size) {
  const auto seg = page_bytes(pool, page_size);
  int64_t total = 0;
  for (auto s : seg) total += s;
  TORCH_CHECK(pages.dim() == 1 && pages.numel() == static_cast<int64_t>(blobs.size()), "one page per blob");
  auto page = pages.to(at::kLong).contiguous();
  const int64_t* p = page.data_ptr<int64_t>();
  std::vector<const uint8_t*> src(blobs.size());
  for (size_t i = 0; i < blobs.size(); ++i) {
    TORCH_CHECK(blobs[i].device().is_cpu() && blobs[i].is_contiguous() && blobs[i].nbytes() == static_cast<size_t>(total),
                "blob ", i, " has ", blobs[i].nbytes(), " bytes, a page has ", total);
    src[i] = static_cast<const uint8_t*>(blobs[i].data_ptr());
  }
  std::vector<uint8_t*> dst;
  for (const auto& t : pool) dst.push_back(static_cast<uint8_t*>(t.data_ptr()));
  // Plain memory copies: other Python threads (the disk writer) may run meanwhile.
  pybind11::gil_scoped_release no_gil;
  at::parallel_for(0, static_cast<int64_t>(blobs.size()), 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const uint8_t* from = src[i];
      for (size_t j = 0; j < dst.size(); ++j) {
        std::memcpy(dst[j] + p[i] * seg[j], from, seg[j]);
        from += seg[j];
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("blobs_to_pages", &blobs_to_pages);
}
