# `cmake --install build --prefix P` gives P/include/cohort, the libraries and a CMake package:
# an outside project does find_package(cohort) and links cohort::cohort (and cohort::models).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set_target_properties(cohort_models PROPERTIES EXPORT_NAME models)
install(TARGETS cohort cohort_models EXPORT cohortTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/cohort DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES ${PROJECT_BINARY_DIR}/include/cohort/version.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/cohort)
install(TARGETS cohort_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

set(cohort_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/cohort)
install(EXPORT cohortTargets NAMESPACE cohort:: DESTINATION ${cohort_cmake_dir})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/cohortConfig.cmake.in
  ${PROJECT_BINARY_DIR}/cohortConfig.cmake INSTALL_DESTINATION ${cohort_cmake_dir})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/cohortConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/cohortConfig.cmake ${PROJECT_BINARY_DIR}/cohortConfigVersion.cmake
  DESTINATION ${cohort_cmake_dir})
