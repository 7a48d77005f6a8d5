// The kvpipe executable: everything lives in the launch library.
#include "launch/cli.h"

#include <malloc.h>

int main(int argc, char** argv) {
  // A step allocates large, short-lived temporaries (a 512-token prompt's MLP activations
  // are megabytes). glibc serves blocks that size with fresh mmaps and trims the heap after
  // them, so every step would fault in and zero new pages: measured, half of a 512-token
  // prefill. Keep such blocks on the heap, and keep the heap.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  return kvpipe::run_cli(argc, argv);
}
