#pragma once
// The shared benchmark harness: timing with warm-up and repeated samples, median and min-max, side-by-side
// comparison of two callables interleaved sample by sample, a printed table, and JSON records.
//
//   bench::Options opt = bench::parse_options(argc, argv);        // --scale 0.5, --smoke, --out DIR
//   auto [ours, ref] = bench::compare(plan, [&] { dtensor::all_reduce(t, sum, g); },
//                                            [&] { gloo::allreduce(o); });
//   bench::Record r{.suite = "collectives", .name = "all_reduce", ...};
//   results.add(r); results.write("bench/results/collectives_gloo_n4.json");
//
// JSON schema (one object per row; BENCHMARKS.md documents it): suite, name, backend, ranks, bytes,
// ours_us, ours_min_us, ours_max_us, ref_name, ref_us, ref_min_us, ref_max_us, ratio (= ours_us / ref_us,
// null without a reference), samples, date, host, then suite-specific fields in `extra`.

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <unistd.h>

namespace bench {

using Clock = std::chrono::steady_clock;

/// Median and range of a set of samples (microseconds).
struct Stats {
  double median = 0;
  double min = 0;
  double max = 0;
  int samples = 0;
  /// compare()'s first result only: the median over samples of ours_i / ref_i, each pair timed back to
  /// back, so a drift of the machine that spans several samples cancels (NaN elsewhere).
  double paired_ratio = NAN;
};

inline Stats stats_of(std::vector<double> v) {
  Stats s;
  if (v.empty()) {
    return s;
  }
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  s.median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  s.min = v.front();
  s.max = v.back();
  s.samples = static_cast<int>(n);
  return s;
}

/// Microseconds since `t0`.
inline double us_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

/// How to sample: `warmup` batches of each side first, then `samples` batches per side, each of `batch`
/// back-to-back calls (a sample is the batch time divided by `batch`).
struct SamplePlan {
  int warmup = 1;
  int samples = 9;
  int batch = 1;
};

/// Times one callable.
template <class F>
Stats measure(const SamplePlan& p, F&& f) {
  for (int w = 0; w < p.warmup; ++w) {
    for (int i = 0; i < p.batch; ++i) {
      f();
    }
  }
  std::vector<double> v;
  for (int s = 0; s < p.samples; ++s) {
    const auto t0 = Clock::now();
    for (int i = 0; i < p.batch; ++i) {
      f();
    }
    v.push_back(us_since(t0) / p.batch);
  }
  return stats_of(std::move(v));
}

/// Times two callables side by side, interleaved sample by sample (ours first on even samples, the
/// reference first on odd ones), so drifts of a shared machine hit both alike. Every rank of a
/// multi-rank benchmark must call it with the same plan (the callables run collectives).
template <class A, class B>
std::pair<Stats, Stats> compare(const SamplePlan& p, A&& ours, B&& ref) {
  auto batch = [&](auto& f) {
    const auto t0 = Clock::now();
    for (int i = 0; i < p.batch; ++i) {
      f();
    }
    return us_since(t0) / p.batch;
  };
  for (int w = 0; w < p.warmup; ++w) {
    batch(ours);
    batch(ref);
  }
  std::vector<double> a;
  std::vector<double> b;
  for (int s = 0; s < p.samples; ++s) {
    if (s % 2 == 0) {
      a.push_back(batch(ours));
      b.push_back(batch(ref));
    } else {
      b.push_back(batch(ref));
      a.push_back(batch(ours));
    }
  }
  std::vector<double> r;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (b[i] > 0) {
      r.push_back(a[i] / b[i]);
    }
  }
  Stats sa = stats_of(std::move(a));
  sa.paired_ratio = stats_of(std::move(r)).median;
  return {sa, stats_of(std::move(b))};
}

/// One row measured in several passes (the whole sweep repeated, so a burst of machine noise hits one
/// pass of a row, not all of its samples): the median of the pass medians (and of the pass paired
/// ratios), the overall min and max, the total sample count.
inline Stats combine_passes(const std::vector<Stats>& passes) {
  std::vector<double> medians;
  std::vector<double> paired;
  Stats s;
  for (const Stats& p : passes) {
    medians.push_back(p.median);
    if (!std::isnan(p.paired_ratio)) {
      paired.push_back(p.paired_ratio);
    }
    s.min = s.samples == 0 ? p.min : std::min(s.min, p.min);
    s.max = std::max(s.max, p.max);
    s.samples += p.samples;
  }
  s.median = stats_of(std::move(medians)).median;
  if (!paired.empty()) {
    s.paired_ratio = stats_of(std::move(paired)).median;
  }
  return s;
}

// ---- options ------------------------------------------------------------------------------------------

struct Options {
  double scale = 1.0;                ///< multiplies sample counts (--scale); --smoke: one sample, no warm-up
  bool smoke = false;                ///< one sample of everything, smallest sizes only (the ctest smoke run)
  std::string out = "bench/results"; ///< folder for JSON (--out); "" = do not write
  std::int64_t max_bytes = 16 << 20; ///< largest size of a sweep (--max-bytes)
  std::vector<std::string> args;     ///< the remaining arguments
};

inline Options parse_options(int argc, char** argv) {
  Options o;
  bool out_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--scale") {
      o.scale = std::stod(next());
    } else if (a == "--smoke") {
      o.smoke = true;
      if (!out_given) {
        o.out.clear(); // a smoke run writes no results unless --out says where
      }
    } else if (a == "--out") {
      o.out = next();
      out_given = true;
    } else if (a == "--max-bytes") {
      o.max_bytes = std::stoll(next());
    } else {
      o.args.push_back(a);
    }
  }
  return o;
}

/// `n` scaled by the options (at least 1; 1 in smoke mode).
inline int scaled(const Options& o, int n) {
  return o.smoke ? 1 : std::max(1, static_cast<int>(std::lround(n * o.scale)));
}

// ---- records and JSON ------------------------------------------------------------------------------------

inline std::string json_escape(std::string_view s) {
  std::string r;
  for (char c : s) {
    switch (c) {
    case '"':
      r += "\\\"";
      break;
    case '\\':
      r += "\\\\";
      break;
    case '\n':
      r += "\\n";
      break;
    default:
      if (static_cast<unsigned char>(c) < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", c);
        r += buf;
      } else {
        r += c;
      }
    }
  }
  return r;
}

inline std::string json_number(double v) {
  if (!std::isfinite(v)) {
    return "null";
  }
  char buf[64];
  if (v == std::floor(v) && std::fabs(v) < 9.0e15) { // byte counts and other integers: exact
    std::snprintf(buf, sizeof buf, "%.0f", v);
  } else {
    std::snprintf(buf, sizeof buf, "%.6g", v);
  }
  return buf;
}

inline std::string json_string(std::string_view s) {
  return "\"" + json_escape(s) + "\"";
}

/// One result row. `extra` holds suite-specific fields as (key, JSON value) pairs.
struct Record {
  std::string suite;
  std::string name;
  std::string backend = "gloo";
  int ranks = 1;
  std::int64_t bytes = 0;
  Stats ours;
  std::string ref_name;
  Stats ref; ///< samples == 0: no reference
  std::vector<std::pair<std::string, std::string>> extra;

  double ratio() const { return ref.samples > 0 && ref.median > 0 ? ours.median / ref.median : NAN; }
  Record& add(std::string key, std::string json_value) {
    extra.emplace_back(std::move(key), std::move(json_value));
    return *this;
  }
  Record& add_num(std::string key, double v) { return add(std::move(key), json_number(v)); }
  Record& add_str(std::string key, std::string_view v) { return add(std::move(key), json_string(v)); }
};

inline std::string today() {
  char buf[32];
  const std::time_t t = std::time(nullptr);
  std::strftime(buf, sizeof buf, "%Y-%m-%d", std::gmtime(&t));
  return buf;
}

inline std::string hostname() {
  char buf[256] = {};
  ::gethostname(buf, sizeof buf - 1);
  return buf;
}

inline std::string to_json(const Record& r) {
  const bool has_ref = r.ref.samples > 0;
  std::string s = "{";
  s += "\"suite\": " + json_string(r.suite);
  s += ", \"name\": " + json_string(r.name);
  s += ", \"backend\": " + json_string(r.backend);
  s += ", \"ranks\": " + std::to_string(r.ranks);
  s += ", \"bytes\": " + std::to_string(r.bytes);
  s += ", \"ours_us\": " + (r.ours.samples ? json_number(r.ours.median) : "null");
  s += ", \"ours_min_us\": " + (r.ours.samples ? json_number(r.ours.min) : "null");
  s += ", \"ours_max_us\": " + (r.ours.samples ? json_number(r.ours.max) : "null");
  s += ", \"ref_name\": " + (r.ref_name.empty() ? std::string("null") : json_string(r.ref_name));
  s += ", \"ref_us\": " + (has_ref ? json_number(r.ref.median) : "null");
  s += ", \"ref_min_us\": " + (has_ref ? json_number(r.ref.min) : "null");
  s += ", \"ref_max_us\": " + (has_ref ? json_number(r.ref.max) : "null");
  s += ", \"ratio\": " + json_number(r.ratio());
  s += ", \"paired_ratio\": " + (has_ref ? json_number(r.ours.paired_ratio) : "null");
  s += ", \"samples\": " + std::to_string(r.ours.samples);
  for (const auto& [k, v] : r.extra) {
    s += ", " + json_string(k) + ": " + v;
  }
  s += "}";
  return s;
}

/// The rows of one run; written as a JSON array (one record per line).
class Results {
public:
  void add(Record r) { rows_.push_back(std::move(r)); }
  const std::vector<Record>& rows() const noexcept { return rows_; }

  /// Writes `dir/file` (creating nothing but the file; the folder must exist). Adds date and host.
  /// `quiet`: no "wrote" line (for a file rewritten after every row, so a run cut short keeps its rows).
  bool write(const Options& o, const std::string& file, bool quiet = false) const {
    if (o.out.empty()) {
      return true;
    }
    const std::string path = o.out + "/" + file;
    std::ofstream f(path);
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", path.c_str());
      return false;
    }
    const std::string stamp =
        ", \"date\": " + json_string(today()) + ", \"host\": " + json_string(hostname());
    f << "[\n";
    for (std::size_t i = 0; i < rows_.size(); ++i) {
      std::string j = to_json(rows_[i]);
      j.insert(j.size() - 1, stamp);
      f << "  " << j << (i + 1 < rows_.size() ? ",\n" : "\n");
    }
    f << "]\n";
    if (!quiet) {
      std::printf("wrote %s (%zu rows)\n", path.c_str(), rows_.size());
    }
    return true;
  }

private:
  std::vector<Record> rows_;
};

// ---- printing -------------------------------------------------------------------------------------------

/// A column-aligned text table.
class Table {
public:
  explicit Table(std::vector<std::string> header) { rows_.push_back(std::move(header)); }
  void row(std::vector<std::string> cells) { rows_.push_back(std::move(cells)); }

  void print(std::FILE* out = stdout) const {
    std::vector<std::size_t> w;
    for (const auto& r : rows_) {
      w.resize(std::max(w.size(), r.size()));
      for (std::size_t i = 0; i < r.size(); ++i) {
        w[i] = std::max(w[i], r[i].size());
      }
    }
    for (std::size_t k = 0; k < rows_.size(); ++k) {
      std::string line;
      for (std::size_t i = 0; i < rows_[k].size(); ++i) {
        const std::string& c = rows_[k][i];
        const bool left =
            i == 0 || (k > 0 && !c.empty() &&
                       !(std::isdigit(static_cast<unsigned char>(c[0])) || c[0] == '-' || c[0] == '.'));
        std::string pad(w[i] - c.size(), ' ');
        line += (i ? "  " : "") + (left ? c + pad : pad + c);
      }
      while (!line.empty() && line.back() == ' ') {
        line.pop_back();
      }
      std::fprintf(out, "%s\n", line.c_str());
      if (k == 0) {
        std::size_t total = 0;
        for (std::size_t i = 0; i < w.size(); ++i) {
          total += w[i] + (i ? 2 : 0);
        }
        std::fprintf(out, "%s\n", std::string(total, '-').c_str());
      }
    }
    std::fflush(out);
  }

private:
  std::vector<std::vector<std::string>> rows_;
};

/// printf into a std::string.
template <class... A>
std::string fmt(const char* f, A... a) {
  char buf[256];
  std::snprintf(buf, sizeof buf, f, a...);
  return buf;
}

/// "4 B", "64 KiB", "16 MiB".
inline std::string size_string(std::int64_t b) {
  if (b >= (1 << 20) && b % (1 << 20) == 0) {
    return std::to_string(b >> 20) + " MiB";
  }
  if (b >= 1024 && b % 1024 == 0) {
    return std::to_string(b >> 10) + " KiB";
  }
  return std::to_string(b) + " B";
}

/// "12.3" with a precision suited to the magnitude.
inline std::string num(double v) {
  if (!std::isfinite(v)) {
    return "-";
  }
  if (v >= 100) {
    return fmt("%.0f", v);
  }
  if (v >= 10) {
    return fmt("%.1f", v);
  }
  return fmt("%.2f", v);
}

/// "median [min-max]".
inline std::string range(const Stats& s) {
  if (s.samples == 0) {
    return "-";
  }
  return num(s.median) + " [" + num(s.min) + "-" + num(s.max) + "]";
}

} // namespace bench
