# Install rules: headers, libhybridep (+ libhybridep_mpi), the `hybridep` command,
# hybridep.pc (+ hybridep-mpi.pc) and hybridepConfig.cmake exporting hybridep::hybridep
# (and hybridep::mpi when it was built).
include(CMakePackageConfigHelpers)
set(HEP_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/hybridep)

install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/hybridep
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} FILES_MATCHING PATTERN "*.h")
set_target_properties(hybridep PROPERTIES EXPORT_NAME hybridep)
install(TARGETS hybridep EXPORT hybridepTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} NAMELINK_COMPONENT Development)
install(TARGETS hybridep_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
if(TARGET hybridep_mpi)
  install(TARGETS hybridep_mpi EXPORT hybridepTargets
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
endif()
install(EXPORT hybridepTargets NAMESPACE hybridep:: DESTINATION ${HEP_CMAKE_DIR})

set(HEP_CONFIG_HAS_MPI ${HEP_BUILT_MPI})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/hybridepConfig.cmake.in
  ${PROJECT_BINARY_DIR}/hybridepConfig.cmake INSTALL_DESTINATION ${HEP_CMAKE_DIR})
# 0.x: a new minor version may change the ABI, so only the same minor is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/hybridepConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/hybridepConfig.cmake
              ${PROJECT_BINARY_DIR}/hybridepConfigVersion.cmake DESTINATION ${HEP_CMAKE_DIR})

# pkg-config: the prefix is found from the .pc file's own place, so `cmake --install
# --prefix P` (chosen after configuring) and a moved install both give right paths.
file(RELATIVE_PATH HEP_PC_TO_PREFIX /p/${CMAKE_INSTALL_LIBDIR}/pkgconfig /p)
configure_file(${PROJECT_SOURCE_DIR}/cmake/hybridep.pc.in ${PROJECT_BINARY_DIR}/hybridep.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/hybridep.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
if(TARGET hybridep_mpi)
  configure_file(${PROJECT_SOURCE_DIR}/cmake/hybridep-mpi.pc.in
                 ${PROJECT_BINARY_DIR}/hybridep-mpi.pc @ONLY)
  install(FILES ${PROJECT_BINARY_DIR}/hybridep-mpi.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
endif()
