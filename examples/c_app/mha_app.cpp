// Run a compiled mhagen layer from C++: the same job as mha_app.c (read x from a raw float32
// file, y = layer(x), print a summary, write y), through a small RAII wrapper of the C API.
//
//   usage: mha_app_cpp ARTIFACT_DIR INPUT.f32 [OUTPUT.f32]
//
// Build against one artifact DIR, with a one-line command:
//   DIR=$PWD/build/m
//   c++ -O2 -std=c++17 examples/c_app/mha_app.cpp -I"$DIR" -L"$DIR" -lmha -Wl,-rpath,"$DIR" -o mha_app_cpp
// or with CMake (examples/c_app/CMakeLists.txt):
//   cmake -S examples/c_app -B build/c_app -DMHA_ARTIFACT="$DIR" && cmake --build build/c_app
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "mha.h"

static_assert(sizeof(mha_value) == sizeof(float) && MHA_FLOAT16 == 0 && MHA_BFLOAT16 == 0,
              "this example runs float32 artifacts; mha_app.c runs float16 and bfloat16 ones");

namespace {

// Owns one handle; throws std::runtime_error with the library's message on any error.
class Attention {
 public:
  explicit Attention(const std::string &artifact_dir) : h_(mha_create(artifact_dir.c_str())) {
    if (h_ == nullptr) throw std::runtime_error(message(mha_last_error_code()));
  }
  ~Attention() { mha_destroy(h_); }
  Attention(const Attention &) = delete;
  Attention &operator=(const Attention &) = delete;

  // x: [MHA_BATCH, MHA_SEQ_LEN, MHA_D_MODEL] floats -> y: [MHA_BATCH, MHA_SEQ_LEN, MHA_OUT_D_MODEL].
  // std::vector storage need not be 64-byte aligned: the library copies through aligned buffers.
  std::vector<float> operator()(const std::vector<float> &x) const {
    std::vector<float> y(MHA_OUTPUT_SIZE);
    if (x.size() != MHA_INPUT_SIZE)
      throw std::runtime_error("x has " + std::to_string(x.size()) + " floats, expected " +
                               std::to_string(MHA_INPUT_SIZE));
    int rc = mha_run(h_, x.data(), MHA_BATCH, MHA_SEQ_LEN, y.data());
    if (rc != MHA_OK) throw std::runtime_error(message(rc));
    return y;
  }

 private:
  static std::string message(int rc) {
    return std::string(mha_status_name(rc)) + ": " + mha_last_error();
  }
  mha_handle *h_;
};

std::vector<float> read_floats(const std::string &path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open input file " + path);
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (bytes.size() != sizeof(float) * MHA_INPUT_SIZE)
    throw std::runtime_error(path + " must hold exactly " + std::to_string(MHA_INPUT_SIZE) +
                             " float32 values ([" + std::to_string(MHA_BATCH) + ", " +
                             std::to_string(MHA_SEQ_LEN) + ", " + std::to_string(MHA_D_MODEL) +
                             "]), it has " + std::to_string(bytes.size()) + " bytes");
  std::vector<float> x(MHA_INPUT_SIZE);
  std::copy(bytes.begin(), bytes.end(), reinterpret_cast<char *>(x.data()));
  return x;
}

}  // namespace

int main(int argc, char **argv) {
  if (argc < 3 || argc > 4) {
    std::cerr << "usage: " << argv[0] << " ARTIFACT_DIR INPUT.f32 [OUTPUT.f32]\n";
    return 1;
  }
  try {
    std::vector<float> x = read_floats(argv[2]);
    Attention layer(argv[1]);
    std::vector<float> y = layer(x);
    double sum = 0.0;
    for (float v : y) sum += v;
    std::printf("y: [%d, %d, %d] float32, mean %.6g\n", MHA_BATCH, MHA_SEQ_LEN, MHA_OUT_D_MODEL,
                sum / double(y.size()));
    for (int b = 0; b < MHA_BATCH; ++b) {
      std::printf("y[%d, 0, :4] =", b);
      for (int j = 0; j < 4 && j < MHA_OUT_D_MODEL; ++j)
        std::printf(" %.6f", y[size_t(b) * MHA_SEQ_LEN * MHA_OUT_D_MODEL + j]);
      std::printf("\n");
    }
    if (argc == 4) {
      std::ofstream f(argv[3], std::ios::binary);
      f.write(reinterpret_cast<const char *>(y.data()), std::streamsize(y.size() * sizeof(float)));
      if (!f.flush()) throw std::runtime_error(std::string("cannot write ") + argv[3]);
      std::printf("wrote %s\n", argv[3]);
    }
  } catch (const std::exception &e) {
    std::cerr << "mha_app_cpp: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
