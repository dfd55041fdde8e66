// Page copies between KV tier entries and the device pools on the CPU.
//
// An entry (a flat uint8 blob) holds one full page of every full-attention
// layer, tensor after tensor: for tensor j, page_size rows of row_bytes[j]
// bytes, which in the pool are rows [page * page_size, (page + 1) *
// page_size) of tensor j. One call moves many pages, each segment one memcpy:
// the restore path costs one pass over the bytes, not a gather and a scatter.
//
// Restores verify each entry's xxh3-64 checksum in the same pass as its copy
// (the page is hashed, then copied while it is still in cache), and disk
// restores read a file's payload straight into the pool rows (readv), then
// hash it there: a verified restore costs little more than the copy or the
// read alone. The hash is the xxhash library the Python `xxhash` module was
// built with (its symbols, looked up once by `bind_xxh3`), so both sides
// compute the same function by construction.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct Xxh3 {
  uint64_t (*oneshot)(const void*, size_t) = nullptr;
  void* (*create)() = nullptr;
  int (*reset)(void*) = nullptr;
  int (*update)(void*, const void*, size_t) = nullptr;
  uint64_t (*digest)(const void*) = nullptr;
  int (*release)(void*) = nullptr;
};

Xxh3 xxh3;

const Xxh3& hasher() {
  TORCH_CHECK(xxh3.oneshot != nullptr, "bind_xxh3 was not called");
  return xxh3;
}

// One streaming state per call site and thread, freed with it.
struct StreamState {
  void* state;
  StreamState() : state(hasher().create()) { TORCH_CHECK(state != nullptr, "XXH3_createState failed"); }
  ~StreamState() { xxh3.release(state); }
  StreamState(const StreamState&) = delete;
  StreamState& operator=(const StreamState&) = delete;
};

std::vector<int64_t> page_bytes(const std::vector<at::Tensor>& pool, int64_t page_size) {
  std::vector<int64_t> out;
  for (const auto& t : pool) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "pool tensors must be contiguous CPU tensors");
    out.push_back(page_size * (t.dim() ? t.stride(0) : 1) * t.element_size());
  }
  return out;
}

std::vector<uint8_t*> pool_bases(const std::vector<at::Tensor>& pool) {
  std::vector<uint8_t*> out;
  for (const auto& t : pool) out.push_back(static_cast<uint8_t*>(t.data_ptr()));
  return out;
}

std::vector<int64_t> as_longs(const at::Tensor& t, size_t n, const char* what) {
  TORCH_CHECK(t.dim() == 1 && t.numel() == static_cast<int64_t>(n), what, ": one per entry");
  auto c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + n);
}

std::vector<const uint8_t*> blob_pointers(const std::vector<at::Tensor>& blobs, int64_t total) {
  std::vector<const uint8_t*> src(blobs.size());
  for (size_t i = 0; i < blobs.size(); ++i) {
    TORCH_CHECK(blobs[i].device().is_cpu() && blobs[i].is_contiguous() && blobs[i].nbytes() == static_cast<size_t>(total),
                "blob ", i, " has ", blobs[i].nbytes(), " bytes, a page has ", total);
    src[i] = static_cast<const uint8_t*>(blobs[i].data_ptr());
  }
  return src;
}

void copy_page(const uint8_t* from, const std::vector<uint8_t*>& dst, const std::vector<int64_t>& seg, int64_t page) {
  for (size_t j = 0; j < dst.size(); ++j) {
    std::memcpy(dst[j] + page * seg[j], from, seg[j]);
    from += seg[j];
  }
}

// The fixed file header of kv_store.py: "<4sHHQQQ" (magic, format version,
// key length, tokens, payload length, payload xxh3-64), then the key.
constexpr size_t kHeaderBytes = 32;

struct Header {
  char magic[4];
  uint16_t version, key_len;
  uint64_t tokens, payload_len, checksum;
};

Header parse_header(const uint8_t* raw) {
  Header h;
  std::memcpy(h.magic, raw, 4);
  std::memcpy(&h.version, raw + 4, 2);
  std::memcpy(&h.key_len, raw + 6, 2);
  std::memcpy(&h.tokens, raw + 8, 8);
  std::memcpy(&h.payload_len, raw + 16, 8);
  std::memcpy(&h.checksum, raw + 24, 8);
  return h;
}

// Read outcomes; kv_store.py names them (READ_STATUS).
enum Status : int32_t { kOk = 0, kMissing = 1, kUnreadable = 2, kTruncated = 3, kGarbled = 4, kChecksum = 5 };

// readv until EOF or every iovec is full; the bytes read, or -1 on an error.
int64_t readv_full(int fd, std::vector<iovec> iov) {
  int64_t total = 0;
  size_t first = 0;
  while (first < iov.size()) {
    ssize_t n = ::readv(fd, iov.data() + first, static_cast<int>(std::min<size_t>(iov.size() - first, IOV_MAX)));
    if (n < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (n == 0) break;
    total += n;
    while (first < iov.size() && static_cast<size_t>(n) >= iov[first].iov_len) {
      n -= static_cast<ssize_t>(iov[first].iov_len);
      ++first;
    }
    if (first < iov.size()) {
      iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + n;
      iov[first].iov_len -= n;
    }
  }
  return total;
}

struct FileSpec {
  std::string path;
  std::string key;
  int64_t file_bytes;
  std::string magic;
  int64_t version;
};

// Opens ``spec.path``, reads it into [head, parts..., one spare byte] and checks
// the header against the key and the expected sizes; the payload's checksum
// is checked by the caller (it knows where the parts are).
int32_t read_entry(const FileSpec& spec, const std::vector<iovec>& parts, uint64_t payload_len, Header* header) {
  const size_t head_len = kHeaderBytes + spec.key.size();
  if (static_cast<uint64_t>(spec.file_bytes) != head_len + payload_len) return kGarbled;
  int fd = ::open(spec.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT ? kMissing : kUnreadable;
  std::vector<uint8_t> head(head_len);
  uint8_t spare;
  std::vector<iovec> iov;
  iov.push_back({head.data(), head_len});
  iov.insert(iov.end(), parts.begin(), parts.end());
  iov.push_back({&spare, 1});  // a file that grew reads one byte more than expected
  const int64_t got = readv_full(fd, iov);
  ::close(fd);
  if (got < 0) return kUnreadable;
  if (got < spec.file_bytes) return kTruncated;
  if (got > spec.file_bytes) return kGarbled;
  *header = parse_header(head.data());
  if (std::memcmp(header->magic, spec.magic.data(), 4) != 0 || header->version != spec.version ||
      header->key_len != spec.key.size() || header->payload_len != payload_len ||
      std::memcmp(head.data() + kHeaderBytes, spec.key.data(), spec.key.size()) != 0)
    return kGarbled;
  return kOk;
}

// read_entry, then the payload (in ``parts``) hashed against the header's
// checksum, with ``state`` (the calling thread's).
int32_t read_verified(const FileSpec& spec, const std::vector<iovec>& parts, uint64_t payload_len,
                      const StreamState& state, Header* header) {
  const int32_t s = read_entry(spec, parts, payload_len, header);
  if (s != kOk) return s;
  xxh3.reset(state.state);
  for (const auto& p : parts) xxh3.update(state.state, p.iov_base, p.iov_len);
  return xxh3.digest(state.state) == header->checksum ? kOk : kChecksum;
}

std::vector<FileSpec> file_specs(const std::vector<std::string>& paths, const std::vector<std::string>& keys,
                                 const at::Tensor& file_bytes, const std::string& magic, int64_t version) {
  TORCH_CHECK(keys.size() == paths.size(), "one key per path");
  TORCH_CHECK(magic.size() == 4, "a 4-byte magic");
  const auto sizes = as_longs(file_bytes, paths.size(), "file_bytes");
  std::vector<FileSpec> specs;
  for (size_t i = 0; i < paths.size(); ++i) specs.push_back({paths[i], keys[i], sizes[i], magic, version});
  return specs;
}

// Entry i (``nbytes`` at address src[i]) checked against expected[i], and
// on a match handed to ``use(i, bytes)``, in parallel with the GIL released.
// Returns how many entries, from the first, were good: the first bad one and
// everything after it do not count (what ``use`` did with them is garbage).
template <class Use>
int64_t verified_prefix(const std::vector<int64_t>& src, const std::vector<int64_t>& expected, int64_t nbytes,
                        Use use) {
  const auto& h = hasher();
  const size_t n = src.size();
  std::vector<uint8_t> good(n, 0);
  {
    pybind11::gil_scoped_release no_gil;
    at::parallel_for(0, static_cast<int64_t>(n), 16, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const auto* from = reinterpret_cast<const uint8_t*>(src[i]);
        good[i] = h.oneshot(from, nbytes) == static_cast<uint64_t>(expected[i]);
        if (good[i]) use(i, from);
      }
    });
  }
  int64_t ok = 0;
  while (ok < static_cast<int64_t>(n) && good[ok]) ++ok;
  return ok;
}

}  // namespace

// The xxhash library inside the shared object at ``path`` (the Python
// module's): resolved once, used by every verified copy.
void bind_xxh3(const std::string& path) {
  void* lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(lib != nullptr, "cannot open ", path, ": ", ::dlerror());
  auto sym = [&](const char* name) {
    void* p = ::dlsym(lib, name);
    TORCH_CHECK(p != nullptr, path, " has no ", name);
    return p;
  };
  Xxh3 bound;
  bound.oneshot = reinterpret_cast<uint64_t (*)(const void*, size_t)>(sym("XXH3_64bits"));
  bound.create = reinterpret_cast<void* (*)()>(sym("XXH3_createState"));
  bound.reset = reinterpret_cast<int (*)(void*)>(sym("XXH3_64bits_reset"));
  bound.update = reinterpret_cast<int (*)(void*, const void*, size_t)>(sym("XXH3_64bits_update"));
  bound.digest = reinterpret_cast<uint64_t (*)(const void*)>(sym("XXH3_64bits_digest"));
  bound.release = reinterpret_cast<int (*)(void*)>(sym("XXH3_freeState"));
  xxh3 = bound;
}

uint64_t xxh3_64(const at::Tensor& blob) {
  TORCH_CHECK(blob.device().is_cpu() && blob.is_contiguous(), "a contiguous CPU tensor");
  return hasher().oneshot(blob.data_ptr(), blob.nbytes());
}

// blobs[i] -> page pages[i] of every pool tensor, unverified.
void blobs_to_pages(const std::vector<at::Tensor>& blobs, const std::vector<at::Tensor>& pool,
                    const at::Tensor& pages, int64_t page_size) {
  const auto seg = page_bytes(pool, page_size);
  int64_t total = 0;
  for (auto s : seg) total += s;
  const auto page = as_longs(pages, blobs.size(), "pages");
  const auto src = blob_pointers(blobs, total);
  const auto dst = pool_bases(pool);
  // Plain memory copies: other Python threads (the disk writer) may run meanwhile.
  pybind11::gil_scoped_release no_gil;
  at::parallel_for(0, static_cast<int64_t>(blobs.size()), 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) copy_page(src[i], dst, seg, page[i]);
  });
}

// Rows ``rows`` of every tensor, tensor after tensor, into a new flat blob
// (pinned when asked), and the blob's xxh3-64 (its bits as an int64): a
// demotion's whole work, done without the GIL so the engine thread runs on
// meanwhile. Runs of consecutive rows (a full page) are one memcpy each.
std::tuple<at::Tensor, int64_t> gather_rows(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& row,
                                            bool pin) {
  const auto& h = hasher();
  const size_t n = row.size();
  int64_t total = 0;
  std::vector<int64_t> row_bytes;
  for (const auto& t : tensors) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.dim() >= 1, "contiguous CPU tensors");
    row_bytes.push_back(t.stride(0) * t.element_size());
    total += row_bytes.back() * static_cast<int64_t>(n);
    for (auto r : row) TORCH_CHECK(0 <= r && r < t.size(0), "row ", r, " out of range");
  }
  auto blob = at::empty({total}, at::TensorOptions().dtype(at::kByte).pinned_memory(pin));
  uint64_t checksum;
  {
    pybind11::gil_scoped_release no_gil;
    uint8_t* out = static_cast<uint8_t*>(blob.data_ptr());
    for (size_t j = 0; j < tensors.size(); ++j) {
      const auto* base = static_cast<const uint8_t*>(tensors[j].data_ptr());
      for (size_t i = 0; i < n;) {
        size_t end = i + 1;
        while (end < n && row[end] == row[end - 1] + 1) ++end;
        const size_t bytes = (end - i) * row_bytes[j];
        std::memcpy(out, base + row[i] * row_bytes[j], bytes);
        out += bytes;
        i = end;
      }
    }
    checksum = h.oneshot(blob.data_ptr(), total);
  }
  return {blob, static_cast<int64_t>(checksum)};
}

// Host entries (flat blobs of one page each, at the addresses ``blobs``, the
// caller keeping them alive) into pool pages, each checked against
// checksums[i] (its bits as an int64) before it is copied. Addresses, not a
// list of tensors: a restore of thousands of pages should not pay a Python
// object conversion per page. Returns how many entries, from the first, were
// good: the first bad one and everything after it are not restored (their
// pages may hold anything).
int64_t verified_blobs_to_pages(const at::Tensor& blobs, const at::Tensor& checksums,
                                const std::vector<at::Tensor>& pool, const at::Tensor& pages, int64_t page_size) {
  const auto seg = page_bytes(pool, page_size);
  int64_t total = 0;
  for (auto s : seg) total += s;
  const size_t n = static_cast<size_t>(blobs.numel());
  const auto page = as_longs(pages, n, "pages");
  const auto dst = pool_bases(pool);
  return verified_prefix(as_longs(blobs, n, "blobs"), as_longs(checksums, n, "checksums"), total,
                         [&](int64_t i, const uint8_t* from) { copy_page(from, dst, seg, page[i]); });
}

// How many host entries (at the addresses ``blobs``, ``nbytes`` each), from
// the first, match their checksums: a restore that copies layer by layer
// later has to know before the first layer is read.
int64_t verify_blobs(const at::Tensor& blobs, const at::Tensor& checksums, int64_t nbytes) {
  const size_t n = static_cast<size_t>(blobs.numel());
  return verified_prefix(as_longs(blobs, n, "blobs"), as_longs(checksums, n, "checksums"), nbytes,
                         [](int64_t, const uint8_t*) {});
}

// One layer's part of host entries into pool pages: bytes [offset, offset +
// page bytes of ``pool``) of each entry go to page pages[i] of the layer's
// tensors (``pool``: its K and V). The calling thread does it alone, with
// the GIL released: it runs beside the forward that waits for this layer.
void copy_layer(const at::Tensor& blobs, int64_t offset, const std::vector<at::Tensor>& pool, const at::Tensor& pages,
                int64_t page_size) {
  const auto seg = page_bytes(pool, page_size);
  const size_t n = static_cast<size_t>(blobs.numel());
  const auto src = as_longs(blobs, n, "blobs");
  const auto page = as_longs(pages, n, "pages");
  const auto dst = pool_bases(pool);
  pybind11::gil_scoped_release no_gil;
  for (size_t i = 0; i < n; ++i) copy_page(reinterpret_cast<const uint8_t*>(src[i]) + offset, dst, seg, page[i]);
}

// Host entries gathered into ``staging`` segment-major (segment j of every
// entry, then segment j + 1, ...: one contiguous run per pool tensor, ready
// for one host-to-device copy each), each entry checked against its checksum
// in the same pass. Returns how many entries, from the first, were good.
int64_t verified_gather(const at::Tensor& blobs, const at::Tensor& checksums, const std::vector<int64_t>& seg,
                        at::Tensor staging) {
  const size_t n = static_cast<size_t>(blobs.numel());
  int64_t total = 0;
  for (auto b : seg) total += b;
  TORCH_CHECK(staging.is_contiguous() && static_cast<int64_t>(staging.nbytes()) >= total * static_cast<int64_t>(n),
              "staging holds every entry");
  uint8_t* out = static_cast<uint8_t*>(staging.data_ptr());
  return verified_prefix(as_longs(blobs, n, "blobs"), as_longs(checksums, n, "checksums"), total,
                         [&](int64_t i, const uint8_t* from) {
                           int64_t base = 0;
                           for (auto b : seg) {
                             std::memcpy(out + base * static_cast<int64_t>(n) + i * b, from, b);
                             from += b;
                             base += b;
                           }
                         });
}

// Files of full-page entries straight into pool pages: each file's payload
// is read into its page's rows, then hashed there. One status per file
// (Status); a page whose status is not kOk holds anything.
at::Tensor files_to_pages(const std::vector<std::string>& paths, const std::vector<std::string>& keys,
                          const at::Tensor& file_bytes, const std::string& magic, int64_t version,
                          const std::vector<at::Tensor>& pool, const at::Tensor& pages, int64_t page_size) {
  const auto specs = file_specs(paths, keys, file_bytes, magic, version);
  const auto seg = page_bytes(pool, page_size);
  uint64_t total = 0;
  for (auto s : seg) total += s;
  const auto page = as_longs(pages, paths.size(), "pages");
  const auto dst = pool_bases(pool);
  auto status = at::empty({static_cast<int64_t>(paths.size())}, at::kInt);
  int32_t* out = status.data_ptr<int32_t>();
  hasher();
  pybind11::gil_scoped_release no_gil;
  at::parallel_for(0, static_cast<int64_t>(paths.size()), 4, [&](int64_t lo, int64_t hi) {
    StreamState state;
    std::vector<iovec> parts(dst.size());
    for (int64_t i = lo; i < hi; ++i) {
      for (size_t j = 0; j < dst.size(); ++j) parts[j] = {dst[j] + page[i] * seg[j], static_cast<size_t>(seg[j])};
      Header header;
      out[i] = read_verified(specs[i], parts, total, state, &header);
    }
  });
  return status;
}

// Files of entries into new host buffers (pinned when asked), for a
// background prefetch: per file (status, tokens, checksum, payload or None).
// The calling thread does the reading; nothing runs in parallel, so a
// prefetch never competes with the engine for more than one core.
std::vector<std::tuple<int32_t, int64_t, int64_t, std::optional<at::Tensor>>> read_files(
    const std::vector<std::string>& paths, const std::vector<std::string>& keys, const at::Tensor& file_bytes,
    const std::string& magic, int64_t version, bool pin) {
  const auto specs = file_specs(paths, keys, file_bytes, magic, version);
  std::vector<std::tuple<int32_t, int64_t, int64_t, std::optional<at::Tensor>>> out;
  std::vector<at::Tensor> buffers;
  for (const auto& spec : specs) {
    const int64_t payload = spec.file_bytes - static_cast<int64_t>(kHeaderBytes + spec.key.size());
    buffers.push_back(at::empty({std::max<int64_t>(payload, 0)}, at::TensorOptions().dtype(at::kByte).pinned_memory(pin)));
  }
  std::vector<Header> headers(specs.size());
  std::vector<int32_t> status(specs.size());
  hasher();
  {
    pybind11::gil_scoped_release no_gil;
    StreamState state;
    for (size_t i = 0; i < specs.size(); ++i) {
      const auto& buf = buffers[i];
      if (buf.numel() == 0) {
        status[i] = kGarbled;
        continue;
      }
      std::vector<iovec> parts{{buf.data_ptr(), static_cast<size_t>(buf.numel())}};
      status[i] = read_verified(specs[i], parts, buf.numel(), state, &headers[i]);
    }
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    if (status[i] == kOk)
      out.emplace_back(kOk, static_cast<int64_t>(headers[i].tokens), static_cast<int64_t>(headers[i].checksum), buffers[i]);
    else
      out.emplace_back(status[i], 0, 0, std::nullopt);
  }
  return out;
}

// The reference a disk restore is measured against: every file read whole
// into its own part of ``into`` (open, read, close; the files' sizes end to
// end), nothing checked or copied further, in parallel like files_to_pages
// or on the calling thread like read_files. Returns the bytes read.
int64_t read_files_raw(const std::vector<std::string>& paths, const at::Tensor& file_bytes, at::Tensor into,
                       bool parallel) {
  const auto sizes = as_longs(file_bytes, paths.size(), "file_bytes");
  std::vector<int64_t> offset(paths.size() + 1, 0);
  for (size_t i = 0; i < paths.size(); ++i) offset[i + 1] = offset[i] + sizes[i];
  TORCH_CHECK(into.device().is_cpu() && into.is_contiguous() && static_cast<int64_t>(into.nbytes()) >= offset.back(),
              "into holds every file");
  uint8_t* base = static_cast<uint8_t*>(into.data_ptr());
  std::atomic<int64_t> total{0};
  pybind11::gil_scoped_release no_gil;
  auto run = [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      int fd = ::open(paths[i].c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) continue;
      const int64_t got = readv_full(fd, {{base + offset[i], static_cast<size_t>(sizes[i])}});
      ::close(fd);
      if (got > 0) total += got;
    }
  };
  if (parallel)
    at::parallel_for(0, static_cast<int64_t>(paths.size()), 4, run);
  else
    run(0, static_cast<int64_t>(paths.size()));
  return total.load();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bind_xxh3", &bind_xxh3);
  m.def("xxh3_64", &xxh3_64);
  m.def("blobs_to_pages", &blobs_to_pages);
  m.def("gather_rows", &gather_rows);
  m.def("verified_blobs_to_pages", &verified_blobs_to_pages);
  m.def("verify_blobs", &verify_blobs);
  m.def("copy_layer", &copy_layer);
  m.def("verified_gather", &verified_gather);
  m.def("files_to_pages", &files_to_pages);
  m.def("read_files", &read_files);
  m.def("read_files_raw", &read_files_raw);
}
