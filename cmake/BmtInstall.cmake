# Installs libbmtrain, its headers and a find_package(bmtrain) config.
include(CMakePackageConfigHelpers)
include(GNUInstallDirs)
install(TARGETS bmt bmt_core EXPORT bmtrainTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/src/bmt DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.h" PATTERN "*_internal.h" EXCLUDE)
if(TARGET bmtrun)
  install(TARGETS bmtrun RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
install(EXPORT bmtrainTargets NAMESPACE bmtrain:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/bmtrain)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/bmtrainConfig.cmake.in
  ${CMAKE_BINARY_DIR}/bmtrainConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/bmtrain)
write_basic_package_version_file(${CMAKE_BINARY_DIR}/bmtrainConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/bmtrainConfig.cmake ${CMAKE_BINARY_DIR}/bmtrainConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/bmtrain)
