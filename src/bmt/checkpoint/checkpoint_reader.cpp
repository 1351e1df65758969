#include "bmt/checkpoint/checkpoint_reader.h"

#include <fcntl.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <future>
#include <map>

#include "bmt/checkpoint/atomic_dir_internal.h"
#include "bmt/checkpoint/parallel_crc_internal.h"
#include "bmt/checkpoint/tensor_dtype.h"
#include "bmt/core/error.h"

namespace bmt::checkpoint {

CheckpointReader::CheckpointReader(const std::string& dir) {
  path_ = resolve_checkpoint_dir(dir);
  const std::string meta_path = join_path(path_, kMetadataFileName);
  meta_ = parse_metadata(read_file(meta_path, kMaxMetadataNbytes), meta_path);
  for (size_t i = 0; i < meta_.entries.size(); ++i) index_.emplace(meta_.entries[i].key, i);
}

const EntryMeta* CheckpointReader::find(const std::string& key) const {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &meta_.entries[it->second];
}

CheckpointReader::OpenFile& CheckpointReader::open_file(int index) {
  auto it = files_.find(index);
  if (it != files_.end()) return it->second;
  const ShardFileInfo& info = meta_.files.at(static_cast<size_t>(index));
  const std::string p = join_path(path_, info.name);
  BMT_CHECK(path_exists(p), "checkpoint ", path_, ": shard file ", info.name, " is missing");
  OpenFile f;
  f.file = std::make_unique<InFile>(p);
#ifdef POSIX_FADV_SEQUENTIAL
  // Larger read-ahead: a load reads most of its file in order (a hint; failure is harmless).
  (void)::posix_fadvise(f.file->fd(), 0, 0, POSIX_FADV_SEQUENTIAL);
#endif
  BMT_CHECK(f.file->size_nbytes() == info.nbytes, "checkpoint ", path_, ": shard file ", info.name, " has ",
            f.file->size_nbytes(), " bytes but the metadata records ", info.nbytes, " (truncated or corrupted)");
  return files_.emplace(index, std::move(f)).first->second;
}

void CheckpointReader::pread_counted(OpenFile& f, int64_t offset, int64_t nbytes, char* dst) {
  f.file->pread_exact(offset, nbytes, dst);
  bytes_read_ += nbytes;
}

namespace {
constexpr int64_t kTaskNbytes = int64_t{4} << 20;  // bytes per read task (whole checksum blocks)

struct ReadSeg {
  int64_t offset, nbytes;  // file bytes
  char* dst;
};
}  // namespace

// verify: whole checksum blocks [lo, hi), read in one pass (bytes no piece wants into scratch), checksummed while
// in the cache; `copies` come out of scratch (blocks whose destinations overlap). Else: `pieces` of verified
// blocks, read as they are.
struct CheckpointReader::Batch::Task {
  int file = 0;
  const InFile* in = nullptr;
  bool verify = false;
  int64_t lo = 0, hi = 0;
  std::vector<ReadSeg> pieces, copies;
  std::vector<uint32_t> crcs;
  int64_t nbytes_read = 0;
  std::future<void> done;

  void run(int64_t B) {
    if (!verify) {
      for (const ReadSeg& p : pieces) in->pread_exact(p.offset, p.nbytes, p.dst);
      return;
    }
    thread_local std::vector<char> scratch;
    if (static_cast<int64_t>(scratch.size()) < hi - lo) scratch.resize(static_cast<size_t>(hi - lo));
    // The segments of [lo, hi) in file order: the pieces, gaps in scratch at their own offset.
    std::vector<ReadSeg> segs;
    int64_t pos = lo;
    for (const ReadSeg& p : pieces) {
      if (p.offset > pos) segs.push_back({pos, p.offset - pos, scratch.data() + (pos - lo)});
      segs.push_back(p);
      pos = p.offset + p.nbytes;
    }
    if (pos < hi) segs.push_back({pos, hi - pos, scratch.data() + (pos - lo)});
    for (const ReadSeg& s : segs) in->pread_exact(s.offset, s.nbytes, s.dst);
    uint32_t crc = 0;
    for (const ReadSeg& s : segs) {
      for (int64_t a = s.offset; a < s.offset + s.nbytes;) {
        const int64_t block_end = (a / B + 1) * B;
        const int64_t b = std::min(s.offset + s.nbytes, block_end);
        crc = crc32_update(crc, s.dst + (a - s.offset), static_cast<size_t>(b - a));
        if (b == block_end || b == hi) {
          crcs.push_back(crc);
          crc = 0;
        }
        a = b;
      }
    }
    for (const ReadSeg& c : copies) std::memcpy(c.dst, scratch.data() + (c.offset - lo), static_cast<size_t>(c.nbytes));
  }
};

CheckpointReader::Batch::~Batch() {
  for (auto& t : tasks_)
    if (t->done.valid()) t->done.wait();  // the tasks write into the caller's buffers
}

void CheckpointReader::Batch::wait() {
  if (waited_) return;
  waited_ = true;
  std::exception_ptr error;
  for (auto& t : tasks_) {  // every task must end before an error leaves
    try {
      t->done.get();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  for (auto& t : tasks_) reader_->bytes_read_ += t->nbytes_read;
  if (error) std::rethrow_exception(error);
  const int64_t B = reader_->meta_.checksum_block_nbytes;
  for (auto& t : tasks_) {
    if (!t->verify) continue;
    const ShardFileInfo& info = reader_->meta_.files[static_cast<size_t>(t->file)];
    OpenFile& f = reader_->files_.at(t->file);
    for (size_t i = 0; i < t->crcs.size(); ++i) {
      const int64_t block = t->lo / B + static_cast<int64_t>(i);
      const uint32_t crc = t->crcs[i], want = info.block_crc32[static_cast<size_t>(block)];
      const int64_t lo = block * B, hi = std::min(info.nbytes, lo + B);
      BMT_CHECK(crc == want, "checkpoint ", reader_->path_, ": checksum mismatch in ", info.name, " (bytes ", lo, "-",
                hi, "): the file is corrupted (crc32 ", crc32_hex(crc), ", expected ", crc32_hex(want), ")");
      f.verified_blocks.insert(block);
    }
  }
}

std::unique_ptr<CheckpointReader::Batch> CheckpointReader::start_spans(const std::vector<FileSpan>& spans) {
  auto batch = std::make_unique<Batch>();
  batch->reader_ = this;
  const int64_t B = meta_.checksum_block_nbytes;
  // The spans cut at block boundaries, by (file, block).
  std::map<std::pair<int, int64_t>, std::vector<ReadSeg>> blocks;
  for (const FileSpan& s : spans) {
    const ShardFileInfo& info = meta_.files.at(static_cast<size_t>(s.file));
    open_file(s.file);
    BMT_ASSERT(s.file_offset >= 0 && s.nbytes >= 0 && s.file_offset + s.nbytes <= info.nbytes, "read outside ",
               info.name);
    for (int64_t a = s.file_offset; a < s.file_offset + s.nbytes;) {
      const int64_t b = std::min(s.file_offset + s.nbytes, (a / B + 1) * B);
      blocks[{s.file, a / B}].push_back({a, b - a, s.dst + (a - s.file_offset)});
      a = b;
    }
  }
  Batch::Task* cur = nullptr;
  auto new_task = [&](int file, bool verify) {
    batch->tasks_.push_back(std::make_unique<Batch::Task>());
    cur = batch->tasks_.back().get();
    cur->file = file;
    cur->in = files_.at(file).file.get();
    cur->verify = verify;
  };
  for (auto& [fb, pieces] : blocks) {
    const auto [file, block] = fb;
    const int64_t lo = block * B, hi = std::min(meta_.files[static_cast<size_t>(file)].nbytes, lo + B);
    std::sort(pieces.begin(), pieces.end(), [](const ReadSeg& x, const ReadSeg& y) { return x.offset < y.offset; });
    bool overlap = false;
    for (size_t i = 1; i < pieces.size(); ++i) overlap |= pieces[i].offset < pieces[i - 1].offset + pieces[i - 1].nbytes;
    if (files_.at(file).verified_blocks.count(block) && !overlap) {
      // Checked before: only the bytes asked for.
      int64_t n = 0;
      for (const ReadSeg& p : pieces) n += p.nbytes;
      if (!cur || cur->verify || cur->file != file || cur->nbytes_read + n > kTaskNbytes) new_task(file, false);
      cur->pieces.insert(cur->pieces.end(), pieces.begin(), pieces.end());
      cur->nbytes_read += n;
      continue;
    }
    if (!cur || !cur->verify || cur->file != file || cur->hi != lo || cur->hi - cur->lo + (hi - lo) > kTaskNbytes) {
      new_task(file, true);
      cur->lo = lo;
    }
    cur->hi = hi;
    cur->nbytes_read += hi - lo;
    auto& to = overlap ? cur->copies : cur->pieces;
    to.insert(to.end(), pieces.begin(), pieces.end());
  }
  for (auto& t : batch->tasks_) {
    Batch::Task* task = t.get();
    task->done = crc_pool().submit([task, B] { task->run(B); });
  }
  return batch;
}

void CheckpointReader::spans_of(const EntryMeta& e, int64_t begin, int64_t end, std::vector<FileSpan>& out) const {
  const int64_t numel = checked_numel(e.shape, e.key);
  BMT_CHECK(0 <= begin && begin <= end && end <= numel, "checkpoint entry ", e.key, ": range [", begin, ", ", end,
            ") outside its ", numel, " elements");
  const int64_t elem = dtype_element_nbytes(e.dtype);
  int64_t pos = begin;
  for (const Piece& p : e.pieces) {
    if (pos >= end) break;
    if (p.elem_end <= pos) continue;
    BMT_CHECK(p.elem_begin <= pos, "checkpoint ", path_, ": entry ", e.key, " has no data for elements [", pos, ", ",
              std::min(end, p.elem_begin), ")");
    const int64_t stop = std::min(end, p.elem_end);
    out.push_back({p.file, p.byte_offset + (pos - p.elem_begin) * elem, (stop - pos) * elem, (pos - begin) * elem,
                   nullptr});
    pos = stop;
  }
  BMT_CHECK(pos >= end, "checkpoint ", path_, ": entry ", e.key, " has no data for elements [", pos, ", ", end, ")");
}

void CheckpointReader::read_into(const EntryMeta& e, int64_t begin, int64_t end, void* dst) {
  std::vector<FileSpan> spans;
  spans_of(e, begin, end, spans);
  for (FileSpan& s : spans) s.dst = static_cast<char*>(dst) + s.dst_offset;
  read_spans(spans);
}

at::Tensor CheckpointReader::read(const EntryMeta& e, int64_t begin, int64_t end) {
  at::Tensor t = at::empty({end - begin}, at::TensorOptions().dtype(scalar_type_of(e.dtype)));
  read_into(e, begin, end, t.data_ptr());
  return t;
}

at::Tensor CheckpointReader::read_full(const EntryMeta& e) {
  return read(e, 0, checked_numel(e.shape, e.key)).view(e.shape);
}

std::vector<std::string> CheckpointReader::verify_all() {
  std::vector<std::string> problems;
  const int64_t B = meta_.checksum_block_nbytes;
  std::vector<char> buf;
  for (size_t i = 0; i < meta_.files.size(); ++i) {
    const ShardFileInfo& info = meta_.files[i];
    try {
      OpenFile& f = open_file(static_cast<int>(i));
      uint32_t whole = 0;
      for (int64_t block = 0; block * B < info.nbytes; ++block) {
        const int64_t lo = block * B, hi = std::min(info.nbytes, lo + B);
        buf.resize(static_cast<size_t>(hi - lo));
        pread_counted(f, lo, hi - lo, buf.data());
        const uint32_t crc = crc32(buf.data(), buf.size());
        whole = crc32_combine(whole, crc, hi - lo);
        if (crc != info.block_crc32[static_cast<size_t>(block)])
          problems.push_back(info.name + ": checksum mismatch in bytes " + std::to_string(lo) + "-" + std::to_string(hi));
      }
      if (whole != info.crc32) problems.push_back(info.name + ": whole-file checksum mismatch");
    } catch (const std::exception& e) {
      problems.push_back(e.what());
    }
  }
  return problems;
}

}  // namespace bmt::checkpoint
