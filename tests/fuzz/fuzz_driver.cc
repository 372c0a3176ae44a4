// A main() for the fuzz targets of tests/fuzz/ in the normal (gcc) build: a deterministic
// regression run of LLVMFuzzerTestOneInput, so `bazel test //...` covers every target
// without clang.
//
//   <target>_test [--runs=N] [--max_len=N] [--seed=N] PATH...
//
// Runs every file under each PATH (a file, or a directory read non-recursively: the seed
// corpus and the crash inputs kept there), then N inputs made from a fixed seed: random
// bytes, and corpus files mutated as libFuzzer would (bit flips, byte sets, inserts, erases,
// copies, truncations, splices, interesting integers). A failing check aborts (a crash);
// exit 0 otherwise. Prints one line with the counts and the time.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

// The input being run, for the crash handler.
const std::string* g_current = nullptr;
char g_crash_path[4096] = "crash-input";

// On a crash (a failed FUZZ_CHECK aborts), writes the input being run to g_crash_path (under
// $TEST_UNDECLARED_OUTPUTS_DIR in `bazel test`: bazel-testlogs/.../test.outputs/) so it can
// be added to the corpus, then dies with the same signal.
void OnCrash(int sig) {
  if (g_current != nullptr) {
    const int fd = open(g_crash_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      (void)!write(fd, g_current->data(), g_current->size());
      close(fd);
      const char msg[] = "fuzz_driver: the crashing input was written to ";
      (void)!write(2, msg, sizeof(msg) - 1);
      (void)!write(2, g_crash_path, strlen(g_crash_path));
      (void)!write(2, "\n", 1);
    }
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

void RunOne(const std::string& in) {
  g_current = &in;
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(in.data()), in.size());
  g_current = nullptr;
}

bool ReadFile(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream s;
  s << in.rdbuf();
  *out = s.str();
  return true;
}

// Files of `path`: itself if a regular file, else its directory's regular files, sorted.
std::vector<std::string> ListInputs(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) {
    std::fprintf(stderr, "fuzz_driver: cannot read %s\n", path.c_str());
    std::exit(2);
  }
  if (S_ISREG(st.st_mode)) return {path};
  std::vector<std::string> files;
  DIR* dir = opendir(path.c_str());
  if (dir == nullptr) return files;
  while (dirent* e = readdir(dir)) {
    const std::string f = path + "/" + e->d_name;
    struct stat fs {};
    if (e->d_name[0] != '.' && stat(f.c_str(), &fs) == 0 && S_ISREG(fs.st_mode)) {
      files.push_back(f);
    }
  }
  closedir(dir);
  std::sort(files.begin(), files.end());
  return files;
}

class Mutator {
 public:
  Mutator(uint64_t seed, size_t max_len) : rng_(seed), max_len_(max_len) {}

  std::string Random() {
    std::string s(Below(std::min<size_t>(max_len_, 256) + 1), '\0');
    for (char& c : s) c = static_cast<char>(Below(256));
    return s;
  }

  std::string Mutate(std::string s, const std::vector<std::string>& corpus) {
    const int n = 1 + static_cast<int>(Below(6));
    for (int i = 0; i < n; ++i) MutateOnce(&s, corpus);
    if (s.size() > max_len_) s.resize(max_len_);
    return s;
  }

  size_t Below(size_t n) { return n == 0 ? 0 : static_cast<size_t>(rng_() % n); }

 private:
  void MutateOnce(std::string* s, const std::vector<std::string>& corpus) {
    static const int64_t kInteresting[] = {
        0,      1,      -1,         0x7f,          0x80,         0xff,
        0x7fff, 0xffff, 0x7fffffff, -0x80000000LL, 0xffffffffLL, 0x7fffffffffffffffLL};
    const size_t at = Below(s->size() + 1);
    switch (Below(9)) {
      case 0:  // Flip a bit.
        if (!s->empty()) (*s)[Below(s->size())] ^= static_cast<char>(1 << Below(8));
        break;
      case 1:  // Set a byte.
        if (!s->empty()) (*s)[Below(s->size())] = static_cast<char>(Below(256));
        break;
      case 2:  // Insert bytes.
        s->insert(at, Below(4) + 1, static_cast<char>(Below(256)));
        break;
      case 3:  // Erase a range.
        if (at < s->size()) s->erase(at, 1 + Below(std::min<size_t>(16, s->size() - at)));
        break;
      case 4:  // Copy a range elsewhere.
        if (!s->empty()) {
          const size_t from = Below(s->size());
          s->insert(at, s->substr(from, 1 + Below(16)));
        }
        break;
      case 5:  // Truncate.
        s->resize(Below(s->size() + 1));
        break;
      case 6:  // Splice with another corpus entry.
        if (!corpus.empty()) {
          const std::string& o = corpus[Below(corpus.size())];
          *s = s->substr(0, at) + o.substr(std::min(o.size(), Below(o.size() + 1)));
        }
        break;
      default: {  // Overwrite 1, 2, 4 or 8 bytes with an interesting little-endian integer.
        const size_t width = size_t{1} << Below(4);
        if (s->size() < width) break;
        const uint64_t v = static_cast<uint64_t>(kInteresting[Below(12)]);
        const size_t pos = Below(s->size() - width + 1);
        for (size_t b = 0; b < width; ++b) (*s)[pos + b] = static_cast<char>(v >> (8 * b));
      }
    }
  }

  std::mt19937_64 rng_;
  const size_t max_len_;
};

}  // namespace

int main(int argc, char** argv) {
  long runs = 20000, max_len = 4096, seed = 1;
  std::vector<std::string> paths;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--runs=", 0) == 0) {
      runs = std::atol(a.c_str() + 7);
    } else if (a.rfind("--max_len=", 0) == 0) {
      max_len = std::atol(a.c_str() + 10);
    } else if (a.rfind("--seed=", 0) == 0) {
      seed = std::atol(a.c_str() + 7);
    } else {
      paths.push_back(a);
    }
  }
  if (const char* dir = std::getenv("TEST_UNDECLARED_OUTPUTS_DIR")) {
    std::snprintf(g_crash_path, sizeof(g_crash_path), "%s/crash-input", dir);
  }
  for (int sig : {SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL}) signal(sig, OnCrash);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::string> corpus;
  for (const std::string& p : paths) {
    for (const std::string& f : ListInputs(p)) {
      std::string data;
      if (!ReadFile(f, &data)) {
        std::fprintf(stderr, "fuzz_driver: cannot read %s\n", f.c_str());
        return 2;
      }
      RunOne(data);
      corpus.push_back(std::move(data));
    }
  }
  if (corpus.empty() && !paths.empty()) {
    std::fprintf(stderr, "fuzz_driver: no corpus files under the paths given\n");
    return 2;  // A target whose corpus went missing would otherwise test almost nothing.
  }
  Mutator m(static_cast<uint64_t>(seed), static_cast<size_t>(max_len));
  for (long i = 0; i < runs; ++i) {
    const std::string in = corpus.empty() || m.Below(4) == 0
                               ? m.Random()
                               : m.Mutate(corpus[m.Below(corpus.size())], corpus);
    RunOne(in);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("fuzz_driver: %zu corpus inputs, %ld generated inputs, %.2f s, no failure\n",
              corpus.size(), runs, s);
  return 0;
}
