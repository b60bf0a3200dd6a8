"""Artifacts that apps embed: a saved module's directory.

  manifest.json   format/version, mhagen and TVM versions, target and CPU features, graph,
                  shapes and dtypes, program (buffers with their param recipes, kernels and
                  their arguments), weight/param tables with sha256, file sha256s, schedule
                  decisions, tuning (records used), content_hash, c_api
  kernel.so       the kernels (TVM library)
  weights.safetensors  the kernels' params (safetensors; the weights in the layer's layout
                  are unpacked from them: files.write_params_file); formats 1-2: weights.bin
                  and params.bin
  kernels.fatbin  GPU artifacts, in place of kernel.so: the device code compiled at build time;
                  the manifest's device_code holds the launch table libmha.so runs (no TVM)
  mha.h           the generated C header (shapes, status codes, the API, documented)
  libmha.so       the C API (rpath $ORIGIN/lib), built from mha_runtime.h/.cc (the runtime,
                  package data) and mha_config.h (this artifact's constants, generated)
  lib/            libmha_impl.so; libtvm_ffi.so and libtvm_runtime.so (about 6 MB), what
                  libmha.so links (CPU): links to one shared copy in mhagen's cache
                  (build_cache), or copies in an artifact saved self_contained=True
  te.txt, tir.txt, source.txt   inspection texts

The manifest describes everything a loader needs (mhagen.load reads manifest, kernel.so and
weights.safetensors; no lowering): manifest.py (format, content hash), save.py, load.py, describe.py
(readable text), files.py (checksums, tensor files), capi.py (the C API), build_cache.py
(compiled C API and TVM runtime kept once in mhagen's cache).
"""
