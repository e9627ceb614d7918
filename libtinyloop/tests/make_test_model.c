/* make_test_model.c — write a valid random model with test_util's writer, for the example,
 * the CI script and benchmarks where Python is not at hand.
 * usage: make_test_model PATH [small|small-int4|small-looped|small-hrm|small-loop|small-v1|bench-int8|
 *                              bench-int4][-act-B]
 * bench-*: d_model 512, 8 heads of 64 (4 kv heads), ffn 1408, 2 pre blocks, 8 loops,
 * vocab 32000, max_seq_len 1024; int4 with groups of 32. looped: every version-2 option
 * (tu_spec_rich); hrm: a two-state core and the attention gate (tu_spec_hrm, version 3); loop: loop
 * attention (tu_spec_loop, version 3; ...-loop-W: its loop_window W); v1: a version-1 file.
 * -act-B (after any kind but v1): block activations in blocks of B (act_block, version 3). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

int main(int argc, char** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: make_test_model PATH [small|small-int4|small-looped|small-hrm|small-loop[-W]|"
                        "small-v1|bench-int8|bench-int4][-act-B]\n");
        return 2;
    }
    const char* kind = argc > 2 ? argv[2] : "small";
    const char* loop = strstr(kind, "looped") ? NULL : strstr(kind, "loop");
    tu_spec spec = strstr(kind, "looped") ? tu_spec_rich()
                   : strstr(kind, "hrm")  ? tu_spec_hrm()
                   : loop                 ? tu_spec_loop()
                                          : tu_spec_default();
    if (loop && loop[4] == '-' && loop[5] >= '0' && loop[5] <= '9')
        spec.loop_window = (uint32_t)strtoul(loop + 5, NULL, 10);
    if (strstr(kind, "v1")) spec.version = 1;
    if (strncmp(kind, "bench", 5) == 0) {
        spec.vocab = 32000, spec.d = 512, spec.heads = 8, spec.kv_heads = 4, spec.head_dim = 64;
        spec.ffn = 1408, spec.n_pre = 2, spec.loops = 8, spec.max_seq = 1024;
    }
    if (strstr(kind, "int4")) spec.int4 = 1, spec.group_size = 32;
    const char* act = strstr(kind, "-act-");
    if (act) spec.version = 3, spec.act_block = (uint32_t)strtoul(act + 5, NULL, 10);
    size_t n;
    uint8_t* bytes = tu_model_bytes(&spec, &n);
    FILE* f = fopen(argv[1], "wb");
    if (!f || fwrite(bytes, 1, n, f) != n) {
        fprintf(stderr, "cannot write %s\n", argv[1]);
        return 1;
    }
    fclose(f);
    free(bytes);
    printf("wrote %s (%zu bytes)\n", argv[1], n);
    return 0;
}
