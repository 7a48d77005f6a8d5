// Linked into every test executable: the environment the tests and the ranks they launch
// run in. One compute thread per rank, and Open MPI's consent to run as root (CI runs as
// root), set before any test starts so that every child process inherits them.
#include <cstdlib>

#ifdef KVPIPE_TESTS_USE_ATEN
#include <ATen/Parallel.h>
#endif

namespace {

const bool kEnvironmentReady = [] {
  setenv("OMP_NUM_THREADS", "1", 1);
  setenv("OPENBLAS_NUM_THREADS", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
#ifdef KVPIPE_TESTS_USE_ATEN
  // The OpenMP runtime read its variables when it loaded; tell LibTorch directly.
  at::set_num_threads(1);
#endif
  return true;
}();

}  // namespace
