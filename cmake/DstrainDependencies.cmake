# Every dependency of dstrain, found once. All come from Debian 12 packages
# (see .ci/install-deps) or the CUDA toolkit at /usr/local/cuda.

find_package(MPI REQUIRED COMPONENTS C CXX)
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(nlohmann_json 3 REQUIRED)
# Eigen: the performance model's least-squares fits (src/plan). Debian: libeigen3-dev.
find_package(Eigen3 3.3 REQUIRED NO_MODULE)
find_package(CLI11 REQUIRED)
find_package(fmt REQUIRED)
find_package(ZLIB REQUIRED)

# xxHash (libxxhash-dev): checksums of dataset files, compared across ranks at start.
find_path(XXHASH_INCLUDE_DIR xxhash.h REQUIRED)
find_library(XXHASH_LIBRARY xxhash REQUIRED)
add_library(dstrain_xxhash INTERFACE)
target_include_directories(dstrain_xxhash SYSTEM INTERFACE ${XXHASH_INCLUDE_DIR})
target_link_libraries(dstrain_xxhash INTERFACE ${XXHASH_LIBRARY})

# PCRE2 (8-bit, UTF + Unicode properties + JIT): the regexes of Hugging Face tokenizer.json files.
find_package(PkgConfig REQUIRED)
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
add_library(dstrain_pcre2 INTERFACE)
target_link_libraries(dstrain_pcre2 INTERFACE PkgConfig::PCRE2)

# Parallel HDF5 (the Open MPI flavour): checkpoints are written collectively through MPI-IO.
set(HDF5_PREFER_PARALLEL ON)
find_package(HDF5 REQUIRED COMPONENTS C)
if(NOT HDF5_IS_PARALLEL)
  message(FATAL_ERROR "parallel HDF5 required: apt-get install libhdf5-openmpi-dev")
endif()

# OpenBLAS, OpenMP flavour: inside an OpenMP parallel region it runs on the calling
# thread, outside it uses all OpenMP threads, so one thread setting governs everything.
find_library(OPENBLAS_OPENMP_LIBRARY openblas
  PATHS /usr/lib/x86_64-linux-gnu/openblas-openmp /usr/lib/aarch64-linux-gnu/openblas-openmp
  NO_DEFAULT_PATH)
find_path(OPENBLAS_OPENMP_INCLUDE_DIR cblas.h
  PATHS /usr/include/x86_64-linux-gnu/openblas-openmp /usr/include/aarch64-linux-gnu/openblas-openmp
  NO_DEFAULT_PATH)
if(NOT OPENBLAS_OPENMP_LIBRARY OR NOT OPENBLAS_OPENMP_INCLUDE_DIR)
  message(FATAL_ERROR "OpenBLAS (OpenMP flavour) not found: apt-get install libopenblas-openmp-dev")
endif()
add_library(dstrain_blas INTERFACE)
target_include_directories(dstrain_blas SYSTEM INTERFACE ${OPENBLAS_OPENMP_INCLUDE_DIR})
target_link_libraries(dstrain_blas INTERFACE ${OPENBLAS_OPENMP_LIBRARY})

# Kokkos from Trilinos: Debian's KokkosConfig.cmake points at the wrong prefix, so
# the headers and library are found by hand (Serial backend: used for memory ownership).
find_path(KOKKOS_INCLUDE_DIR Kokkos_Core.hpp PATHS /usr/include/trilinos REQUIRED)
find_library(KOKKOS_CORE_LIBRARY trilinos_kokkoscore REQUIRED)
add_library(dstrain_kokkos INTERFACE)
target_include_directories(dstrain_kokkos SYSTEM INTERFACE ${KOKKOS_INCLUDE_DIR})
target_link_libraries(dstrain_kokkos INTERFACE ${KOKKOS_CORE_LIBRARY} ${CMAKE_DL_LIBS})

# CUDA backend (-DDSTRAIN_CUDA=ON): kernels for sm_80 and sm_90 (A100, H100/H200), cuBLASLt,
# NCCL. It compiles without a GPU; its tests skip, by name, where none is present.
set(DSTRAIN_HAVE_CUDA OFF)
if(DSTRAIN_CUDA)
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    message(FATAL_ERROR "DSTRAIN_CUDA=ON but no CUDA compiler was found: install the CUDA toolkit at "
                        "/usr/local/cuda (nvcc, cuBLAS, NCCL) or configure with -DDSTRAIN_CUDA=OFF")
  endif()
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 80 90)
  endif()
  set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
  set(CMAKE_CUDA_STANDARD 17)
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
  if(NOT NCCL_INCLUDE_DIR OR NOT NCCL_LIBRARY)
    message(FATAL_ERROR "DSTRAIN_CUDA=ON but NCCL was not found beside the CUDA toolkit (${CUDAToolkit_LIBRARY_DIR})")
  endif()
  set(DSTRAIN_HAVE_CUDA ON)
endif()
message(STATUS "dstrain CUDA backend: ${DSTRAIN_HAVE_CUDA}")
