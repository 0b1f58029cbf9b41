// What this library was compiled against, kept in its read-only data as one string that
// prophet_tf/_compat.py finds in the file WITHOUT loading it: a library built against another
// TensorFlow fails inside dlopen (undefined symbols, or static initializers running against
// another TensorFlow's internals) before any function of it could be asked.
#include "tf_build_info.h"

extern "C" {

// Format (parsed by prophet_tf/_compat.py, keep in step):
//   "PROPHET_TF_BUILD_STAMP tensorflow=<version> cxx11_abi=<0|1>;"
// as tf_configure found them: tf.__version__ and tf.sysconfig.CXX11_ABI_FLAG of the TensorFlow
// whose headers and framework library the build used.
__attribute__((visibility("default"), used)) extern const char prophet_build_stamp[] =
    "PROPHET_TF_BUILD_STAMP tensorflow=" PROPHET_BUILT_AGAINST_TF_VERSION
    " cxx11_abi=" PROPHET_BUILT_AGAINST_TF_CXX11_ABI ";";

}  // extern "C"
