#include "bmt/checkpoint/checkpoint_reader.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <future>

#include "bmt/checkpoint/atomic_dir_internal.h"
#include "bmt/checkpoint/parallel_crc_internal.h"
#include "bmt/checkpoint/state_slices.h"
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
  BMT_CHECK(f.file->size_nbytes() == info.nbytes, "checkpoint ", path_, ": shard file ", info.name, " has ",
            f.file->size_nbytes(), " bytes but the metadata records ", info.nbytes, " (truncated or corrupted)");
  return files_.emplace(index, std::move(f)).first->second;
}

void CheckpointReader::pread_counted(OpenFile& f, int64_t offset, int64_t nbytes, char* dst) {
  f.file->pread_exact(offset, nbytes, dst);
  bytes_read_ += nbytes;
}

void CheckpointReader::read_whole_blocks(int index, int64_t offset, int64_t nbytes, char* dst) {
  OpenFile& f = open_file(index);
  const ShardFileInfo& info = meta_.files[static_cast<size_t>(index)];
  const int64_t B = meta_.checksum_block_nbytes;
  // Tasks of whole blocks (~4 MiB) on the checksum workers, each reading its part and checksumming it right away
  // while it is in the cache: several reads in flight (page-cache copies on several cores, a deeper queue for
  // the disk), one pass over the bytes.
  constexpr int64_t kTaskNbytes = int64_t{4} << 20;
  const int64_t task_nbytes = std::max<int64_t>(1, kTaskNbytes / B) * B;
  struct Task {
    int64_t lo, len;  // bytes [lo, lo + len) of the run
    std::vector<uint32_t> crcs;
    std::future<void> done;
  };
  std::vector<Task> tasks;
  tasks.reserve(static_cast<size_t>((nbytes + task_nbytes - 1) / task_nbytes));
  const InFile* file = f.file.get();
  for (int64_t lo = 0; lo < nbytes; lo += task_nbytes) {
    tasks.push_back({lo, std::min(task_nbytes, nbytes - lo), {}, {}});
    Task* t = &tasks.back();
    t->done = crc_pool().submit([t, file, dst, offset, B] {
      file->pread_exact(offset + t->lo, t->len, dst + t->lo);
      for (int64_t b = 0; b < t->len; b += B)
        t->crcs.push_back(crc32(dst + t->lo + b, static_cast<size_t>(std::min(B, t->len - b))));
    });
  }
  std::exception_ptr error;
  for (Task& t : tasks) {  // every task must end before dst or the tasks go
    try {
      t.done.get();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  bytes_read_ += nbytes;
  if (error) std::rethrow_exception(error);
  for (const Task& t : tasks) {
    for (size_t i = 0; i < t.crcs.size(); ++i) {
      const int64_t block = (offset + t.lo) / B + static_cast<int64_t>(i);
      const uint32_t crc = t.crcs[i], want = info.block_crc32[static_cast<size_t>(block)];
      const int64_t lo = block * B, hi = std::min(info.nbytes, lo + B);
      BMT_CHECK(crc == want, "checkpoint ", path_, ": checksum mismatch in ", info.name, " (bytes ", lo, "-", hi,
                "): the file is corrupted (crc32 ", crc32_hex(crc), ", expected ", crc32_hex(want), ")");
      f.verified_blocks.insert(block);
    }
  }
}

void CheckpointReader::read_file_range(int index, int64_t offset, int64_t nbytes, char* dst) {
  OpenFile& f = open_file(index);
  const ShardFileInfo& info = meta_.files[static_cast<size_t>(index)];
  const int64_t B = meta_.checksum_block_nbytes;
  BMT_ASSERT(offset >= 0 && nbytes >= 0 && offset + nbytes <= info.nbytes, "read outside ", info.name);
  while (nbytes > 0) {
    const int64_t block = offset / B;
    const int64_t block_begin = block * B, block_end = std::min(info.nbytes, block_begin + B);
    if (offset == block_begin && nbytes >= block_end - block_begin) {
      // A run of whole blocks: straight into dst.
      int64_t run = block_end - block_begin;
      while (offset + run < info.nbytes && nbytes - run >= std::min(B, info.nbytes - (offset + run)))
        run += std::min(B, info.nbytes - (offset + run));
      if (run >= 2 * B || !f.verified_blocks.count(block)) {
        read_whole_blocks(index, offset, run, dst);
        dst += run;
        offset += run;
        nbytes -= run;
        continue;
      }
    }
    const int64_t take = std::min(nbytes, block_end - offset);
    if (f.verified_blocks.count(block)) {
      pread_counted(f, offset, take, dst);  // checked before: read only what is needed
    } else {
      block_buf_.resize(static_cast<size_t>(block_end - block_begin));
      pread_counted(f, block_begin, block_end - block_begin, block_buf_.data());
      const uint32_t crc = crc32(block_buf_.data(), block_buf_.size());
      BMT_CHECK(crc == info.block_crc32[static_cast<size_t>(block)], "checkpoint ", path_, ": checksum mismatch in ",
                info.name, " (bytes ", block_begin, "-", block_end, "): the file is corrupted (crc32 ", crc32_hex(crc),
                ", expected ", crc32_hex(info.block_crc32[static_cast<size_t>(block)]), ")");
      f.verified_blocks.insert(block);
      std::memcpy(dst, block_buf_.data() + (offset - block_begin), static_cast<size_t>(take));
    }
    dst += take;
    offset += take;
    nbytes -= take;
  }
}

void CheckpointReader::read_into(const EntryMeta& e, int64_t begin, int64_t end, void* dst_v) {
  const int64_t numel = checked_numel(e.shape, e.key);
  BMT_CHECK(0 <= begin && begin <= end && end <= numel, "checkpoint entry ", e.key, ": range [", begin, ", ", end,
            ") outside its ", numel, " elements");
  const int64_t elem = dtype_element_nbytes(e.dtype);
  char* dst = static_cast<char*>(dst_v);
  int64_t pos = begin;
  for (const Piece& p : e.pieces) {
    if (pos >= end) break;
    if (p.elem_end <= pos) continue;
    BMT_CHECK(p.elem_begin <= pos, "checkpoint ", path_, ": entry ", e.key, " has no data for elements [", pos, ", ",
              std::min(end, p.elem_begin), ")");
    const int64_t stop = std::min(end, p.elem_end);
    read_file_range(p.file, p.byte_offset + (pos - p.elem_begin) * elem, (stop - pos) * elem, dst + (pos - begin) * elem);
    pos = stop;
  }
  BMT_CHECK(pos >= end, "checkpoint ", path_, ": entry ", e.key, " has no data for elements [", pos, ", ", end, ")");
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
