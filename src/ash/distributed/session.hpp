#pragma once
// The MPI session of a process (docs/design.md §2, §7): starting and ending
// MPI, and ending every rank when one fails.
#include <string>

namespace ash::dist {

// True when an MPI launcher (mpiexec, mpirun, srun) started this process: its
// environment names the process's rank (Open MPI, MPICH/Hydra, PMI, PMIx, Slurm).
bool launched_by_mpi();

// MPI_Init when needed, MPI_Finalize at scope exit. only_under_launcher: no
// MPI at all unless launched_by_mpi() (a one-process `ash` needs no MPI
// start-up, which forks a singleton runtime); else also as a singleton.
class Session {
 public:
  Session(int* argc, char*** argv, bool only_under_launcher = false);
  ~Session();
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  bool owns_ = false;
  int rank_ = 0, size_ = 1;
};

// Ends every rank with exit code `code` after printing msg once: rank 0
// prints; another rank waits a moment (if rank 0 fails alike, its abort ends
// this rank first), then prints with its rank number. Never returns.
[[noreturn]] void fail_all(const std::string& msg, int code);

}  // namespace ash::dist
