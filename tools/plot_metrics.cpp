// bmt-plot-metrics: renders train_gpt's JSONL metrics log as a PNG loss curve, with no external libraries.
//   bmt-plot-metrics metrics.jsonl out.png [--title TEXT]
// Reads "step", "loss" (train) and "eval_loss" (held-out; null on most steps) from each line, and draws both
// against step: axes, ~6 nice tick labels per axis in a built-in 5x7 bitmap font, a legend, and the last
// task accuracy when the log has one. A resumed run's repeated steps keep their last value.
// The PNG writer is minimal: 8-bit RGB, filter 0 on every row, zlib stream of stored (uncompressed) deflate
// blocks, CRC-32 per chunk and Adler-32 over the raw data.
#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace {

// ---- data -------------------------------------------------------------------------------------------------

// The number after "key": in a flat JSON object line; nullopt for null or a missing key.
std::optional<double> json_number(const std::string& line, const std::string& key) {
  const std::string quoted = "\"" + key + "\"";
  size_t p = line.find(quoted);
  if (p == std::string::npos) return std::nullopt;
  p = line.find(':', p + quoted.size());
  if (p == std::string::npos) return std::nullopt;
  const char* s = line.c_str() + p + 1;
  while (*s == ' ' || *s == '\t') ++s;
  char* end = nullptr;
  const double v = std::strtod(s, &end);
  if (end == s || !std::isfinite(v)) return std::nullopt;  // null, a string, or garbage
  return v;
}

struct Series {
  std::map<double, double> train, eval;  // step -> loss
  std::optional<double> last_task_acc;
};

Series read_metrics(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open '" + path + "'");
  Series s;
  std::string line;
  while (std::getline(in, line)) {
    const std::optional<double> step = json_number(line, "step");
    if (!step) continue;
    if (auto v = json_number(line, "loss")) s.train[*step] = *v;
    if (auto v = json_number(line, "eval_loss")) s.eval[*step] = *v;
    if (auto v = json_number(line, "task_acc")) s.last_task_acc = *v;
  }
  return s;
}

// ---- raster -----------------------------------------------------------------------------------------------

struct Rgb {
  uint8_t r, g, b;
};

class Image {
 public:
  Image(int w, int h) : w_(w), h_(h), px_(static_cast<size_t>(w) * h * 3, 255) {}
  int width() const { return w_; }
  int height() const { return h_; }
  const std::vector<uint8_t>& pixels() const { return px_; }

  void set(int x, int y, Rgb c) {
    if (x < 0 || y < 0 || x >= w_ || y >= h_) return;
    uint8_t* p = &px_[(static_cast<size_t>(y) * w_ + x) * 3];
    p[0] = c.r, p[1] = c.g, p[2] = c.b;
  }
  void fill_rect(int x0, int y0, int x1, int y1, Rgb c) {
    for (int y = y0; y <= y1; ++y)
      for (int x = x0; x <= x1; ++x) set(x, y, c);
  }
  // Bresenham, `thick` pixels wide.
  void line(int x0, int y0, int x1, int y1, Rgb c, int thick = 1) {
    const int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0), sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
    int err = dx + dy;
    for (;;) {
      fill_rect(x0 - (thick - 1) / 2, y0 - (thick - 1) / 2, x0 + thick / 2, y0 + thick / 2, c);
      if (x0 == x1 && y0 == y1) break;
      const int e2 = 2 * err;
      if (e2 >= dy) err += dy, x0 += sx;
      if (e2 <= dx) err += dx, y0 += sy;
    }
  }
  // 5x7 glyphs scaled by `scale`; unknown characters are blank. Returns the text width in pixels.
  int text(int x, int y, const std::string& s, Rgb c, int scale = 2);
  static int text_width(const std::string& s, int scale = 2) { return static_cast<int>(s.size()) * 6 * scale; }

 private:
  int w_, h_;
  std::vector<uint8_t> px_;
};

const std::map<char, std::array<uint8_t, 7>>& font() {
  static const std::map<char, std::array<uint8_t, 7>> glyphs = {
    {'0', {0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E}},
    {'1', {0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E}},
    {'2', {0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F}},
    {'3', {0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E}},
    {'4', {0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02}},
    {'5', {0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E}},
    {'6', {0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E}},
    {'7', {0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08}},
    {'8', {0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E}},
    {'9', {0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C}},
    {'.', {0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C}},
    {'-', {0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00}},
    {'+', {0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00}},
    {':', {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00}},
    {'%', {0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03}},
    {'(', {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02}},
    {')', {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08}},
    {'/', {0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00}},
    {'=', {0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00}},
    {',', {0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08}},
    {'_', {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F}},
    {'a', {0x00, 0x00, 0x0E, 0x01, 0x0F, 0x11, 0x0F}},
    {'b', {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1E}},
    {'c', {0x00, 0x00, 0x0E, 0x10, 0x10, 0x11, 0x0E}},
    {'d', {0x01, 0x01, 0x0D, 0x13, 0x11, 0x11, 0x0F}},
    {'e', {0x00, 0x00, 0x0E, 0x11, 0x1F, 0x10, 0x0E}},
    {'f', {0x06, 0x09, 0x08, 0x1C, 0x08, 0x08, 0x08}},
    {'g', {0x00, 0x0F, 0x11, 0x11, 0x0F, 0x01, 0x0E}},
    {'h', {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11}},
    {'i', {0x04, 0x00, 0x0C, 0x04, 0x04, 0x04, 0x0E}},
    {'j', {0x02, 0x00, 0x06, 0x02, 0x02, 0x12, 0x0C}},
    {'k', {0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12}},
    {'l', {0x0C, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E}},
    {'m', {0x00, 0x00, 0x1A, 0x15, 0x15, 0x11, 0x11}},
    {'n', {0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11}},
    {'o', {0x00, 0x00, 0x0E, 0x11, 0x11, 0x11, 0x0E}},
    {'p', {0x00, 0x00, 0x1E, 0x11, 0x1E, 0x10, 0x10}},
    {'q', {0x00, 0x00, 0x0D, 0x13, 0x0F, 0x01, 0x01}},
    {'r', {0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10}},
    {'s', {0x00, 0x00, 0x0E, 0x10, 0x0E, 0x01, 0x1E}},
    {'t', {0x08, 0x08, 0x1C, 0x08, 0x08, 0x09, 0x06}},
    {'u', {0x00, 0x00, 0x11, 0x11, 0x11, 0x13, 0x0D}},
    {'v', {0x00, 0x00, 0x11, 0x11, 0x11, 0x0A, 0x04}},
    {'w', {0x00, 0x00, 0x11, 0x11, 0x15, 0x15, 0x0A}},
    {'x', {0x00, 0x00, 0x11, 0x0A, 0x04, 0x0A, 0x11}},
    {'y', {0x00, 0x00, 0x11, 0x11, 0x0F, 0x01, 0x0E}},
    {'z', {0x00, 0x00, 0x1F, 0x02, 0x04, 0x08, 0x1F}},
  };
  return glyphs;
}

int Image::text(int x, int y, const std::string& s, Rgb c, int scale) {
  int cx = x;
  for (char ch : s) {
    auto it = font().find(ch);
    if (it == font().end()) it = font().find(static_cast<char>(std::tolower(static_cast<unsigned char>(ch))));
    if (it != font().end())
      for (int row = 0; row < 7; ++row)
        for (int col = 0; col < 5; ++col)
          if (it->second[row] & (0x10 >> col)) fill_rect(cx + col * scale, y + row * scale, cx + col * scale + scale - 1, y + row * scale + scale - 1, c);
    cx += 6 * scale;
  }
  return cx - x;
}

// ---- PNG --------------------------------------------------------------------------------------------------

uint32_t crc32(const uint8_t* data, size_t n, uint32_t crc = 0) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ data[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint32_t adler32(const std::vector<uint8_t>& data) {
  uint32_t a = 1, b = 0;
  for (uint8_t v : data) a = (a + v) % 65521, b = (b + a) % 65521;
  return (b << 16) | a;
}

void put_be32(std::vector<uint8_t>& out, uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<uint8_t>(v >> s));
}

void put_chunk(std::vector<uint8_t>& png, const char type[4], const std::vector<uint8_t>& data) {
  put_be32(png, static_cast<uint32_t>(data.size()));
  const size_t start = png.size();
  png.insert(png.end(), type, type + 4);
  png.insert(png.end(), data.begin(), data.end());
  put_be32(png, crc32(&png[start], png.size() - start));
}

std::vector<uint8_t> encode_png(const Image& img) {
  std::vector<uint8_t> raw;  // filter byte 0 + RGB row
  const size_t row_nbytes = static_cast<size_t>(img.width()) * 3;
  for (int y = 0; y < img.height(); ++y) {
    raw.push_back(0);
    raw.insert(raw.end(), img.pixels().begin() + y * row_nbytes, img.pixels().begin() + (y + 1) * row_nbytes);
  }
  std::vector<uint8_t> z = {0x78, 0x01};  // zlib: deflate, 32K window, no dictionary
  for (size_t pos = 0; pos < raw.size() || raw.empty();) {
    const size_t n = std::min<size_t>(65535, raw.size() - pos);
    const bool last = pos + n == raw.size();
    z.push_back(last ? 1 : 0);  // BFINAL, BTYPE 00 (stored)
    z.push_back(static_cast<uint8_t>(n)), z.push_back(static_cast<uint8_t>(n >> 8));
    z.push_back(static_cast<uint8_t>(~n)), z.push_back(static_cast<uint8_t>(~n >> 8));
    z.insert(z.end(), raw.begin() + pos, raw.begin() + pos + n);
    pos += n;
    if (last) break;
  }
  put_be32(z, adler32(raw));
  std::vector<uint8_t> png = {0x89, 'P', 'N', 'G', 0x0D, 0x0A, 0x1A, 0x0A};
  std::vector<uint8_t> ihdr;
  put_be32(ihdr, static_cast<uint32_t>(img.width()));
  put_be32(ihdr, static_cast<uint32_t>(img.height()));
  ihdr.insert(ihdr.end(), {8, 2, 0, 0, 0});  // 8-bit, RGB, deflate, adaptive filtering, no interlace
  put_chunk(png, "IHDR", ihdr);
  put_chunk(png, "IDAT", z);
  put_chunk(png, "IEND", {});
  return png;
}

// ---- plot -------------------------------------------------------------------------------------------------

// ~`count` ticks at 1, 2 or 5 times a power of ten covering [lo, hi].
std::vector<double> nice_ticks(double lo, double hi, int count) {
  const double raw = (hi - lo) / std::max(1, count);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double step = mag * (raw / mag >= 5 ? 5 : raw / mag >= 2 ? 2 : 1);
  std::vector<double> ticks;
  for (double t = std::ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push_back(std::fabs(t) < step * 1e-9 ? 0 : t);
  return ticks;
}

std::string tick_label(double v) {
  char buf[32];
  if (std::fabs(v) >= 1e5) std::snprintf(buf, sizeof buf, "%.0e", v);
  else if (v == std::floor(v)) std::snprintf(buf, sizeof buf, "%.0f", v);
  else std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}

Image plot(const Series& s, const std::string& title) {
  constexpr int W = 900, H = 540, L = 90, R = 30, T = 50, B = 70;
  const Rgb black{0, 0, 0}, grid{225, 225, 225}, train_c{70, 120, 200}, eval_c{230, 120, 20};
  Image img(W, H);
  double x0 = 1e300, x1 = -1e300, y0 = 1e300, y1 = -1e300;
  for (const auto* m : {&s.train, &s.eval})
    for (const auto& [x, y] : *m) x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
  if (x1 <= x0) x1 = x0 + 1;
  if (y1 <= y0) y1 = y0 + 1;
  const double pad = 0.05 * (y1 - y0);
  y0 = std::max(0.0, y0 - pad), y1 += pad;
  auto px = [&](double x) { return L + static_cast<int>(std::lround((x - x0) / (x1 - x0) * (W - L - R))); };
  auto py = [&](double y) { return H - B - static_cast<int>(std::lround((y - y0) / (y1 - y0) * (H - T - B))); };

  for (double t : nice_ticks(y0, y1, 6)) {
    img.line(L, py(t), W - R, py(t), grid);
    const std::string lab = tick_label(t);
    img.text(L - 8 - Image::text_width(lab), py(t) - 7, lab, black);
  }
  for (double t : nice_ticks(x0, x1, 6)) {
    img.line(px(t), T, px(t), H - B, grid);
    const std::string lab = tick_label(t);
    img.text(px(t) - Image::text_width(lab) / 2, H - B + 10, lab, black);
  }
  img.line(L, H - B, W - R, H - B, black, 2);  // axes
  img.line(L, T, L, H - B, black, 2);
  img.text((L + W - R) / 2 - Image::text_width("step") / 2, H - B + 38, "step", black);
  img.text(8, T - 28, "loss", black);
  img.text(L + 10, 14, title, black);

  auto draw = [&](const std::map<double, double>& m, Rgb c, int thick, bool dots) {
    int lx = -1, ly = -1;
    for (const auto& [x, y] : m) {
      const int X = px(x), Y = py(y);
      if (lx >= 0) img.line(lx, ly, X, Y, c, thick);
      if (dots) img.fill_rect(X - 3, Y - 3, X + 3, Y + 3, c);
      lx = X, ly = Y;
    }
  };
  draw(s.train, train_c, 1, s.train.size() < 2);
  draw(s.eval, eval_c, 2, true);

  int lx = W - R - 200, ly = T + 10;  // legend
  img.fill_rect(lx, ly + 5, lx + 24, ly + 7, train_c);
  img.text(lx + 32, ly, "train loss", black);
  img.fill_rect(lx, ly + 27, lx + 24, ly + 29, eval_c);
  img.text(lx + 32, ly + 22, "held-out loss", black);
  if (s.last_task_acc) {
    char buf[48];
    std::snprintf(buf, sizeof buf, "task acc %.1f%%", 100.0 * *s.last_task_acc);
    img.text(lx + 32, ly + 44, buf, black);
  }
  return img;
}

// Writes `bytes` to a temporary file beside `path` and renames it over `path`: a failure (a full disk) leaves no
// partial PNG under the final name and says why, with the free space of the filesystem.
void write_file_atomic(const std::string& path, const std::vector<uint8_t>& bytes) {
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  auto fail = [&](const std::string& what, int err) {
    ::unlink(tmp.c_str());
    std::string why = std::strerror(err);
    if (err == ENOSPC || err == EDQUOT || err == EFBIG) {
      const size_t slash = path.rfind('/');
      const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
      struct statvfs st {};
      if (err != EFBIG && ::statvfs(dir.c_str(), &st) == 0) {
        char buf[128];
        std::snprintf(buf, sizeof buf, " (%.1f MiB free in %s)",
                      static_cast<double>(st.f_bavail) * static_cast<double>(st.f_frsize) / (1 << 20), dir.c_str());
        why += buf;
      } else if (err == EFBIG) {
        why += " (the file-size limit: check `ulimit -f`)";
      }
    }
    throw std::runtime_error("cannot " + what + " '" + path + "': " + why);
  };
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("create", errno);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const int err = w < 0 ? errno : ENOSPC;
      ::close(fd);
      fail("write", err);
    }
    done += static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    fail("write", err);
  }
  if (::close(fd) != 0) fail("write", errno);
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("rename the temporary file onto", errno);
}

}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGXFSZ, SIG_IGN);  // a file-size limit: an error (EFBIG), not death
  if (argc != 3 && !(argc == 5 && std::string(argv[3]) == "--title")) {
    std::fprintf(stderr, "usage: bmt-plot-metrics metrics.jsonl out.png [--title TEXT]\n");
    return 2;
  }
  try {
    const Series s = read_metrics(argv[1]);
    if (s.train.empty() && s.eval.empty()) throw std::runtime_error(std::string("no loss values in '") + argv[1] + "'");
    const std::vector<uint8_t> png = encode_png(plot(s, argc == 5 ? argv[4] : argv[1]));
    write_file_atomic(argv[2], png);
    std::printf("wrote %s (%zu train points, %zu eval points)\n", argv[2], s.train.size(), s.eval.size());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bmt-plot-metrics: %s\n", e.what());
    return 1;
  }
  return 0;
}
