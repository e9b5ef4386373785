# The Debian package: `cpack -G DEB -B DIR` in the build folder (or `cmake --build build --target package`)
# gives cohort_<version>_<arch>.deb with the library, headers, CMake package, CLI, bash completion
# and man page. The man page is made from the CLI's --help by help2man (Debian's help2man); the
# completion script by `cohort completion bash`.
find_program(HELP2MAN help2man)
set(cohort_share ${PROJECT_BINARY_DIR}/share)
add_custom_command(OUTPUT ${cohort_share}/bash-completion/completions/cohort
  COMMAND ${CMAKE_COMMAND} -E make_directory ${cohort_share}/bash-completion/completions
  COMMAND $<TARGET_FILE:cohort_cli> completion bash > ${cohort_share}/bash-completion/completions/cohort
  DEPENDS cohort_cli VERBATIM)
set(cohort_package_files ${cohort_share}/bash-completion/completions/cohort)
if(HELP2MAN)
  add_custom_command(OUTPUT ${cohort_share}/man/man1/cohort.1.gz
    COMMAND ${CMAKE_COMMAND} -E make_directory ${cohort_share}/man/man1
    COMMAND ${PROJECT_SOURCE_DIR}/packaging/man_page.sh $<TARGET_FILE:cohort_cli>
      ${cohort_share}/man/man1/cohort.1.gz
    DEPENDS cohort_cli ${PROJECT_SOURCE_DIR}/packaging/man_page.sh VERBATIM)
  list(APPEND cohort_package_files ${cohort_share}/man/man1/cohort.1.gz)
  install(FILES ${cohort_share}/man/man1/cohort.1.gz DESTINATION ${CMAKE_INSTALL_MANDIR}/man1)
else()
  message(STATUS "cohort: no help2man: the package has no man page (scripts/setup.sh installs it)")
endif()
add_custom_target(cohort_package_files ALL DEPENDS ${cohort_package_files})
install(FILES ${cohort_share}/bash-completion/completions/cohort
  DESTINATION ${CMAKE_INSTALL_DATADIR}/bash-completion/completions)
install(FILES ${PROJECT_SOURCE_DIR}/packaging/copyright ${PROJECT_SOURCE_DIR}/README.md
  DESTINATION ${CMAKE_INSTALL_DOCDIR})
# The guides, as Markdown (the rendered site with the API reference: the docs target).
install(DIRECTORY ${PROJECT_SOURCE_DIR}/docs/ DESTINATION ${CMAKE_INSTALL_DOCDIR}/guides
  FILES_MATCHING PATTERN "*.md" PATTERN "README.md" EXCLUDE)

set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME cohort)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_CONTACT "The cohort developers <cohort@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "distributed training for libtorch in C++")
set(CPACK_PACKAGE_DESCRIPTION
  "What Ray Train, PyTorch DDP, FSDP and DeepSpeed give Python users, for C++ training loops on
libtorch: data, ZeRO, pipeline and tensor parallelism, local SGD and parameter servers, fault
tolerance and elastic groups, data pipelines, hyperparameter search, TensorBoard and a live
dashboard. The static libraries, headers and CMake package (find_package(cohort)), and the
cohort command.")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION devel)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
set(CPACK_DEBIAN_COMPRESSION_TYPE xz)
# The command's shared libraries, found by dpkg-shlibdeps; and what a program built against the
# headers and static libraries needs: the -dev packages of their public and link dependencies.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(cohort_dev_depends libtorch-dev nlohmann-json3-dev libcli11-dev libgloo-dev zlib1g-dev
  libssl-dev libcpp-httplib-dev)
if(COHORT_WITH_OPENCV)
  list(APPEND cohort_dev_depends libopencv-core-dev libopencv-imgproc-dev libopencv-imgcodecs-dev)
endif()
list(JOIN cohort_dev_depends ", " CPACK_DEBIAN_PACKAGE_DEPENDS)
# An optimised BLAS behind libblas.so.3 for libtorch's CPU matrix products (runtime/blas.h): without
# one they run on netlib's reference library.
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS
  "g++, cmake, dataset-fashion-mnist, libopenblas0-openmp | libopenblas0 | libblis4")
# The rendezvous of `cohort launch --rdzv etcd://` runs on some host of the job's network.
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "etcd-server")
include(CPack)
