# ctest -R install_and_consume: install the build tree into a private prefix,
# then configure, build and run examples/consumer against it with nothing but
# find_package(AdjointSharding).
foreach(v BUILD_DIR SOURCE_DIR WORK_DIR CXX_COMPILER)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "InstallTest.cmake needs -D${v}=...")
  endif()
endforeach()
file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")

function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install test step failed (${rc}): ${ARGN}")
  endif()
endfunction()

step(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${prefix}")
# HDF5 and xxHash are private dependencies: no installed header may include them
# (ash::io's headers, io/hdf5_*.hpp and io/atomic_write.hpp, stay in the build tree).
file(GLOB_RECURSE installed_headers "${prefix}/include/ash/*.hpp")
if(NOT installed_headers)
  message(FATAL_ERROR "install test: no headers under ${prefix}/include/ash")
endif()
foreach(h ${installed_headers})
  file(STRINGS "${h}" private_includes REGEX "#[ \t]*include[ \t]*[<\"](hdf5|xxhash)\\.h[>\"]")
  if(private_includes)
    message(FATAL_ERROR "install test: ${h} is installed but includes a private dependency: ${private_includes}")
  endif()
endforeach()
# The prefix list goes through an initial-cache file: a ';' on a command line splits arguments.
string(REPLACE "|" ";" prefix_path "${prefix};${PREFIX_PATH}")
file(WRITE "${WORK_DIR}/init.cmake" "set(CMAKE_PREFIX_PATH \"${prefix_path}\" CACHE STRING \"\")\n")
step(${CMAKE_COMMAND} -C "${WORK_DIR}/init.cmake" -S "${SOURCE_DIR}" -B "${WORK_DIR}/build"
     "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" -DCMAKE_BUILD_TYPE=Release)
step(${CMAKE_COMMAND} --build "${WORK_DIR}/build" -j 2)
step("${WORK_DIR}/build/ash_consumer")
step("${prefix}/bin/ash" inspect --help)
# With PYTHON (a build with the Python module): the module alone (cmake -S python) against
# the same prefix, as a GPU machine builds it from the bundle, then imported and run.
if(DEFINED PYTHON AND PYTHON)
  step(${CMAKE_COMMAND} -C "${WORK_DIR}/init.cmake" -S "${PYTHON_SOURCE_DIR}" -B "${WORK_DIR}/python"
       "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DPython_EXECUTABLE=${PYTHON}")
  step(${CMAKE_COMMAND} --build "${WORK_DIR}/python" -j 2)
  step(${CMAKE_COMMAND} -E env "PYTHONPATH=${WORK_DIR}/python" "${PYTHON}" -c
       "import numpy as np, adjoint_sharding as a; from adjoint_sharding import _core; o = _core.StackOptions(); o.width, o.state, o.layers = 4, 2, 1; p = {n: np.full(s, 0.1) for n, s in _core.stack_layout(o)}; y = np.ones((1, 3, 4)); k = np.zeros_like(y); _core.stack_forward(p, o, y, k); assert a.device() == 'cpu' and np.all(np.isfinite(k)) and np.any(k != y), k; print('the module alone:', a.device(), a.backend)")
endif()
message(STATUS "install test passed: ${prefix}")
