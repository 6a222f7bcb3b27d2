# The library's sources, relative to src/: one list read by src/CMakeLists.txt and by
# fuzz/CMakeLists.txt (which builds them with the fuzzer's sanitizers and has no MPI).
set(ASH_LIBRARY_SOURCES
  ash/core/config.cpp
  ash/core/documents.cpp
  ash/kernels/half_storage.cpp
  ash/kernels/matmul.cpp
  ash/core/memory.cpp
  ash/core/profiler.cpp
  ash/core/sizes.cpp
  ash/plan/memory_plan.cpp
  ash/model/params.cpp
  ash/model/ssm_layer.cpp
  ash/model/embedding.cpp
  ash/model/head.cpp
  ash/model/forward.cpp
  ash/model/blockwise_forward.cpp
  ash/grad/engine.cpp
  ash/grad/blockwise_engine.cpp
  ash/grad/stack_adjoint.cpp
  ash/grad/backprop.cpp
  ash/grad/adjoint.cpp
  ash/grad/adjoint_exact.cpp
  ash/grad/workspace.cpp
  ash/io/tokens.cpp
  ash/io/hdf5.cpp
  ash/io/checkpoint.cpp
  ash/io/dataset.cpp
  ash/io/run_lock.cpp
  ash/model/generator.cpp
  ash/train/optimizer.cpp
  ash/train/trainer.cpp
  ash/train/evaluate.cpp
  ash/distributed/run_context.cpp
  ash/app/run_config.cpp
  ash/app/token_windows.cpp
)
# Built only with ASH_ENABLE_MPI: these include <mpi.h>.
set(ASH_MPI_SOURCES
  ash/distributed/comm.cpp
  ash/distributed/distributed_engine.cpp
  ash/distributed/sequence_blockwise.cpp
  ash/distributed/sharded_io.cpp
)
# Built only with a CUDA Kokkos: run.matmul's cuBLAS call (links CUDA::cublas).
set(ASH_CUDA_SOURCES
  ash/kernels/impl/cublas_gemm.cpp
)
