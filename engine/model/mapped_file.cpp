#include "engine/model/mapped_file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>

namespace kvpipe {
namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  std::string message = path + ": " + what;
  std::replace_if(
      message.begin(), message.end(), [](char c) { return c == '\n' || c == '\r'; }, ' ');
  throw std::invalid_argument(message);
}

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a regular file";
}

[[noreturn]] void refuse_kind(const std::string& path, mode_t mode) {
  const std::string kind = kind_of(mode);
  fail(path, kind.rfind("not ", 0) == 0 ? kind : "is " + kind + ", not a regular file");
}

// ---------------------------------------------------------------------------------------------
// The SIGBUS table. The handler may run on any thread at any moment, so it reads only plain
// arrays and lock-free atomics, and calls only write(2) and _exit(2). A slot is published by
// storing its begin address last (release) and withdrawn by clearing it first.

constexpr int kSlots = 1024;  // a sharded 405B model has 191 shards
constexpr size_t kPathBytes = 512;
constexpr size_t kPrefixBytes = 64;

struct Slot {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  char path[kPathBytes];
};
static_assert(std::atomic<uintptr_t>::is_always_lock_free, "the SIGBUS handler needs lock-free atomics");

Slot g_slots[kSlots];
std::mutex g_slots_mutex;
std::once_flag g_install_once;
struct sigaction g_previous {};
char g_prefix[kPrefixBytes] = "kvpipe: ";  // "kvpipe: rank R: " inside a multi-rank job

void write_all(const char* text, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(STDERR_FILENO, text, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;
    text += w;
    n -= static_cast<size_t>(w);
  }
}

void on_sigbus(int signal, siginfo_t* info, void* context) {
  // Only a fault the kernel raised has an address; a SIGBUS sent by kill has none.
  const bool fault = info != nullptr && info->si_code > 0;
  const auto address = fault ? reinterpret_cast<uintptr_t>(info->si_addr) : 0;
  for (Slot& slot : g_slots) {
    if (!fault) break;
    const uintptr_t begin = slot.begin.load(std::memory_order_acquire);
    if (begin == 0 || address < begin || address >= slot.end.load(std::memory_order_acquire)) continue;
    const int saved = errno;
    static const char kError[] = "error: ";
    static const char kWhat[] = ": the file was truncated or changed while mapped\n";
    write_all(g_prefix, ::strnlen(g_prefix, kPrefixBytes));
    write_all(kError, sizeof(kError) - 1);
    write_all(slot.path, ::strnlen(slot.path, kPathBytes));
    write_all(kWhat, sizeof(kWhat) - 1);
    errno = saved;
    ::_exit(2);
  }
  // Not a model file's page: whoever handled SIGBUS before handles it, else the default
  // action, taken by raising the signal again once this handler returns.
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(signal, info, context);
    return;
  }
  if ((g_previous.sa_flags & SA_SIGINFO) == 0 && g_previous.sa_handler != SIG_DFL &&
      g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(signal);
    return;
  }
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  sigemptyset(&fallback.sa_mask);
  ::sigaction(SIGBUS, &fallback, nullptr);
  ::raise(SIGBUS);
}

void install_sigbus_handler() {
  // Inside an MPI job the line carries the rank, as every other error of a rank does.
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (rank == nullptr) rank = std::getenv("PMIX_RANK");
  if (rank != nullptr && size != nullptr && std::atoi(size) > 1)
    std::snprintf(g_prefix, sizeof(g_prefix), "kvpipe: rank %d: ", std::atoi(rank));
  struct sigaction action {};
  action.sa_sigaction = on_sigbus;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGBUS, &action, &g_previous);
}

int register_mapping(const void* data, size_t size, const std::string& path) {
  std::call_once(g_install_once, install_sigbus_handler);
  const std::lock_guard<std::mutex> lock(g_slots_mutex);
  for (int i = 0; i < kSlots; ++i) {
    Slot& slot = g_slots[i];
    if (slot.begin.load(std::memory_order_relaxed) != 0) continue;
    // A path longer than the slot is cut at its start: the file name is the telling part.
    const size_t keep = std::min(path.size(), kPathBytes - 1);
    std::memcpy(slot.path, path.data() + (path.size() - keep), keep);
    slot.path[keep] = '\0';
    const auto begin = reinterpret_cast<uintptr_t>(data);
    slot.end.store(begin + size, std::memory_order_release);
    slot.begin.store(begin, std::memory_order_release);
    return i;
  }
  return -1;  // beyond the table a truncated file still stops the process, only unnamed
}

void unregister_mapping(int index) {
  if (index < 0) return;
  const std::lock_guard<std::mutex> lock(g_slots_mutex);
  g_slots[index].begin.store(0, std::memory_order_release);
  g_slots[index].end.store(0, std::memory_order_release);
}

struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

int open_regular_file(const std::string& path) {
  struct stat info {};
  // stat first names what the path is; the descriptor's own fstat below settles it, since the
  // path may be replaced in between.
  if (::stat(path.c_str(), &info) != 0) fail(path, std::string("cannot open: ") + std::strerror(errno));
  if (!S_ISREG(info.st_mode)) refuse_kind(path, info.st_mode);
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) fail(path, std::string("cannot open: ") + std::strerror(errno));
  FdCloser closer{fd};
  if (::fstat(fd, &info) != 0) fail(path, std::string("cannot stat: ") + std::strerror(errno));
  if (!S_ISREG(info.st_mode)) refuse_kind(path, info.st_mode);
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  closer.fd = -1;
  return fd;
}

std::string read_regular_file(const std::string& path, uint64_t max_bytes) {
  const FdCloser fd{open_regular_file(path)};
  struct stat info {};
  if (::fstat(fd.fd, &info) == 0 && static_cast<uint64_t>(info.st_size) > max_bytes)
    fail(path, "is " + std::to_string(info.st_size) + " bytes, more than the " + std::to_string(max_bytes) +
                   " this file may hold");
  // The size is a hint only: a regular file may grow, and /proc's report 0.
  std::string text;
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd.fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(path, std::string("cannot read: ") + std::strerror(errno));
    if (n == 0) break;
    if (text.size() + static_cast<uint64_t>(n) > max_bytes)
      fail(path, "holds more than the " + std::to_string(max_bytes) + " bytes this file may hold");
    text.append(buffer, static_cast<size_t>(n));
  }
  return text;
}

MappedFile::MappedFile(const std::string& path) : path_(path) {
  const FdCloser fd{open_regular_file(path)};
  struct stat info {};
  if (::fstat(fd.fd, &info) != 0) fail(path, std::string("cannot stat: ") + std::strerror(errno));
  size_ = static_cast<size_t>(info.st_size);
  if (size_ == 0) return;
  void* map = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd.fd, 0);
  if (map == MAP_FAILED) fail(path, std::string("cannot map: ") + std::strerror(errno));
  data_ = static_cast<const uint8_t*>(map);
  slot_ = register_mapping(data_, size_, path_);
}

MappedFile::~MappedFile() {
  unregister_mapping(slot_);
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

}  // namespace kvpipe
