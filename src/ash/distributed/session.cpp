#include "ash/distributed/session.hpp"

#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

namespace ash::dist {

namespace {
// A copy of MPI_COMM_WORLD used only by fail_all, so its barrier can never
// match a barrier of the run itself.
MPI_Comm g_failure_comm = MPI_COMM_NULL;
}  // namespace

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS",
                        "MV2_COMM_WORLD_SIZE", "SLURM_PROCID"})
    if (std::getenv(v)) return true;
  return false;
}

Session::Session(int* argc, char*** argv, bool only_under_launcher) {
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited && only_under_launcher && !launched_by_mpi()) return;  // rank 0 of 1, no MPI
  if (!inited) {
    int provided = 0;
    MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
    owns_ = true;
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
  if (g_failure_comm == MPI_COMM_NULL) MPI_Comm_dup(MPI_COMM_WORLD, &g_failure_comm);
}

Session::~Session() {
  int fin = 0;
  MPI_Finalized(&fin);
  if (!owns_ || fin) return;
  if (g_failure_comm != MPI_COMM_NULL) MPI_Comm_free(&g_failure_comm);
  MPI_Finalize();
}

namespace {

// True when every rank reaches fail_all within `wait` (they all met the same
// error, e.g. a bad configuration or layout): then no abort is needed.
bool all_ranks_failed(std::chrono::milliseconds wait) {
  if (g_failure_comm == MPI_COMM_NULL) return false;
  MPI_Request req;
  MPI_Ibarrier(g_failure_comm, &req);
  const auto until = std::chrono::steady_clock::now() + wait;
  int done = 0;
  while (!done && std::chrono::steady_clock::now() < until) {
    MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return done != 0;  // a pending request is abandoned: the abort below ends the job
}
}  // namespace

void fail_all(const std::string& msg, int code) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size > 1 && all_ranks_failed(std::chrono::milliseconds(1500))) {
    // One message, and an orderly end with the error's exit code (no abort banner).
    if (rank == 0) std::fprintf(stderr, "ash: error: %s\n", msg.c_str());
    std::fflush(stderr);
    MPI_Comm_free(&g_failure_comm);
    MPI_Finalize();
    std::exit(code);
  }
  if (size > 1 && rank != 0)
    std::fprintf(stderr, "ash: error (rank %d): %s\n", rank, msg.c_str());
  else
    std::fprintf(stderr, "ash: error: %s\n", msg.c_str());
  std::fflush(stderr);
  // Give mpiexec's output forwarding time to pass the message on before the
  // abort tears the job down (seen lost under load without it).
  if (size > 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  if (size == 1) {
    MPI_Finalize();
    std::exit(code);
  }
  MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

}  // namespace ash::dist
