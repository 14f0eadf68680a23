/* Preloaded into the MPI tests of the sanitized build: a dlclose that keeps
 * the library loaded. Open MPI unloads its components (mca_*.so) at
 * MPI_Finalize, and LeakSanitizer then cannot name the frames of what they
 * kept, so tests/dist/lsan.supp could not match them. */
int dlclose(void *handle);
int dlclose(void *handle) {
  (void)handle;
  return 0;
}
