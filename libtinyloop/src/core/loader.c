/* loader.c — read a `.tinyloop` file into private memory and validate it against
 * docs/spec.md §6: version 3 or 2 (a version-2 file has no stop_ids, exit gate, exit_threshold,
 * two-state core, attention gate, loop attention or block activations), or version 1 read as the
 * version-2 model it describes (§6.5).
 *
 * The file is read once, front to back, with pread: the header, the tensor table, then each
 * tensor into its own allocation (the bytes between tensors are summed and dropped). The
 * checksum is computed over exactly those copies and every rule is checked on them, so what
 * the kernels run is what was validated, and the file is never touched again: a host may
 * truncate or rewrite it while the model is open (a mapping would SIGBUS, or hand the kernels
 * values that no rule checked, such as int4 multipliers past the i32 accumulator bound).
 *
 * The checks report in the same order as the Python reader (tinyloop/modelfile.py): size,
 * magic, version, header_bytes, file_bytes, checksum, the config (name first, then header
 * order, the version-2 fields, then version 3's core_cycles, attn_gate, loop_window and
 * act_block), table bounds, each table entry, overlaps, the tensor set (required and optional),
 * tensor values, exit_threshold, reserved bytes, flags. The first broken rule is reported. The
 * checksum needs every byte, but the structure (config, table, tensor set) says where the bytes
 * go, so the structure is checked first and a rule it breaks is reported only once the checksum
 * is known to be good.
 * All size/offset/shape arithmetic is done in u64 with explicit overflow checks; nothing
 * outside [0, file size) is read, and a file that shrinks while it is read is TL_ERR_IO.
 * The optional meta.* texts are checked, then dropped: the Python layer reads them itself;
 * the optional stop_ids (version 3) are checked and copied into the config; the optional exit
 * gate (version 3, its three tensors together) is kept in the tl_file.
 * Not here: repacking weights for the kernels (cpu/pack.c).
 */
#include "core/loader.h"

#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/alloc.h"
#include "base/crc32.h"
#include "base/errors.h"
#include "base/le.h"

enum { HEADER_BYTES = 256, ENTRY_BYTES = 96, ALIGN = 64, MAX_NDIM = 4, CHECKSUM_AT = 24 };
enum { DT_F32 = 1, DT_I8 = 2, DT_U8 = 3, DT_I32 = 4 };
enum { SCRATCH_BYTES = 64 << 10 }; /* the read buffer for bytes that are summed, not kept */

#define bad(...) tl_fail_bad_file("model file", __VA_ARGS__)

#define TRY(expr)                             \
    do {                                      \
        tl_status st_ = (expr);               \
        if (st_ != TL_OK) return st_;         \
    } while (0)

/* ---- reading ------------------------------------------------------------------------------ */

/* The one front-to-back pass over the file: `crc` sums every byte before `pos` (the checksum
 * field taken as zero), as it was copied. */
typedef struct reader {
    int fd;
    const char* path;
    uint64_t size;     /* the file's size when it was opened                         */
    uint64_t pos;
    uint32_t crc;
    uint8_t* scratch;  /* [SCRATCH_BYTES], allocated on first use; owned              */
} reader;

/* Fill dst with the n bytes at `offset` (at most 1 GiB per call, well below SSIZE_MAX). */
static tl_status read_at(const reader* r, uint8_t* dst, size_t n, uint64_t offset) {
    while (n > 0) {
        const ssize_t got = pread(r->fd, dst, n < ((size_t)1 << 30) ? n : (size_t)1 << 30, (off_t)offset);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) return tl_fail(TL_ERR_IO, "cannot read '%s': %s", r->path, strerror(errno));
        if (got == 0)
            return tl_fail(TL_ERR_IO, "cannot read '%s': it ends at byte %llu but had %llu bytes when "
                           "opened (it changed while being read)", r->path, (unsigned long long)offset,
                           (unsigned long long)r->size);
        dst += got;
        n -= (size_t)got;
        offset += (uint64_t)got;
    }
    return TL_OK;
}

static tl_status read_header(reader* r, uint8_t* h) {
    TRY(read_at(r, h, HEADER_BYTES, 0));
    const uint8_t zero[4] = {0, 0, 0, 0};
    r->crc = tl_crc32(0, h, CHECKSUM_AT);
    r->crc = tl_crc32(r->crc, zero, 4);
    r->crc = tl_crc32(r->crc, h + CHECKSUM_AT + 4, HEADER_BYTES - CHECKSUM_AT - 4);
    r->pos = HEADER_BYTES;
    return TL_OK;
}

/* The next n bytes into dst, summed. */
static tl_status read_kept(reader* r, void* dst, uint64_t n) {
    TRY(read_at(r, dst, (size_t)n, r->pos));
    r->crc = tl_crc32(r->crc, dst, (size_t)n);
    r->pos += n;
    return TL_OK;
}

/* The next n bytes summed only. */
static tl_status read_skipped(reader* r, uint64_t n) {
    if (n > 0 && !r->scratch && !(r->scratch = tl_alloc(SCRATCH_BYTES))) return tl_fail_oom("file read buffer");
    while (n > 0) {
        const uint64_t chunk = n < SCRATCH_BYTES ? n : SCRATCH_BYTES;
        TRY(read_kept(r, r->scratch, chunk));
        n -= chunk;
    }
    return TL_OK;
}

/* ---- header --------------------------------------------------------------------------- */

/* A NUL-padded field: at least one NUL and zeros after the first. *len = bytes before it. */
static tl_status check_nul_padded(const uint8_t* field, size_t size, const char* what,
                                  size_t* len) {
    const uint8_t* nul = memchr(field, 0, size);
    if (!nul) return bad("%s: no NUL terminator", what);
    for (const uint8_t* p = nul; p < field + size; p++)
        if (*p) return bad("%s: nonzero bytes after the NUL terminator", what);
    *len = (size_t)(nul - field);
    return TL_OK;
}

/* Where strict UTF-8 (no overlongs, surrogates or code points above U+10FFFF, as Python
 * decodes) breaks: the offset of the first invalid sequence, or n when s[0..n) is valid. */
static size_t utf8_error(const uint8_t* s, size_t n) {
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        size_t extra;
        uint32_t lo = 0x80, hi = 0xbf; /* allowed range of the second byte */
        if (c < 0x80) { i++; continue; }
        if (c >= 0xc2 && c <= 0xdf) extra = 1;
        else if (c >= 0xe0 && c <= 0xef) {
            extra = 2;
            if (c == 0xe0) lo = 0xa0;
            if (c == 0xed) hi = 0x9f;
        } else if (c >= 0xf0 && c <= 0xf4) {
            extra = 3;
            if (c == 0xf0) lo = 0x90;
            if (c == 0xf4) hi = 0x8f;
        } else return i;
        if (n - i <= extra) return i;
        if (s[i + 1] < lo || s[i + 1] > hi) return i;
        for (size_t k = 2; k <= extra; k++)
            if ((s[i + k] & 0xc0) != 0x80) return i;
        i += extra + 1;
    }
    return n;
}

static tl_status check_range(const char* field, int64_t value, int64_t lo, int64_t hi) {
    if (value < lo || value > hi)
        return bad("%s: must be an int in %lld .. %lld, got %lld", field, (long long)lo,
                   (long long)hi, (long long)value);
    return TL_OK;
}

static tl_status check_flag(const char* field, uint32_t value) {
    if (value > 1) return bad("%s: must be 0 or 1, got %u", field, value);
    return TL_OK;
}

static tl_status check_positive(const char* field, float value) {
    if (!isfinite(value) || !(value > 0))
        return bad("%s: must be a finite float > 0, got %g", field, (double)value);
    return TL_OK;
}

/* core_cycles (header offset 220, docs/spec.md §6.1): 0 .. 256; a two-state core (>= 1) has two
 * stacks (an even n_core_blocks), no injection and no step norm, and its width in n_layers. Set
 * in c only once it holds, so the checks before it count the one-state width. */
static tl_status check_core_cycles(tl_config* c, uint32_t cycles) {
    TRY(check_range("core_cycles", cycles, 0, 256));
    if (cycles == 0) return TL_OK;
    if (c->n_core_blocks % 2)
        return bad("n_core_blocks: must be even with core_cycles >= 1 (two stacks), got %u", c->n_core_blocks);
    if (c->injection) return bad("injection: must be 0 with core_cycles >= 1, got %u", c->injection);
    if (c->step_norm) return bad("step_norm: must be 0 with core_cycles >= 1, got %u", c->step_norm);
    c->core_cycles = cycles;
    if (tl_n_layers(c, c->default_loops) > TL_MAX_CACHE_LAYERS)
        return bad("n_pre_blocks + default_loops * ((core_cycles + 1) * n_core_blocks / 2 + n_coda_blocks): "
                   "must be <= %d, got %zu", TL_MAX_CACHE_LAYERS, tl_n_layers(c, c->default_loops));
    return TL_OK;
}

/* loop_window (header offset 228, docs/spec.md §6.1): 0 or W_l in 1 .. 2^20; loop attention
 * (>= 1) runs in a one-state core (core_cycles = 0) without the attention gate (attn_gate = 0). */
static tl_status check_loop_window(tl_config* c, uint32_t window) {
    TRY(check_range("loop_window", window, 0, 1 << 20));
    if (window == 0) return TL_OK;
    if (c->core_cycles) return bad("loop_window: needs core_cycles 0 (a one-state core), got %u", c->core_cycles);
    if (c->attn_gate) return bad("loop_window: excludes the attention gate (attn_gate 1), got %u", c->attn_gate);
    c->loop_window = window;
    return TL_OK;
}

/* act_block (header offset 232, docs/spec.md §6.1): 0 or B in 1 .. 2^16 dividing every linear's
 * input width: d_model, then n_heads * head_dim, then ffn_dim. */
static tl_status check_act_block(tl_config* c, uint32_t block) {
    TRY(check_range("act_block", block, 0, 1 << 16));
    if (block == 0) return TL_OK;
    if (c->d_model % block) return bad("act_block: must divide d_model (%u), got %u", c->d_model, block);
    if ((c->n_heads * c->head_dim) % block)
        return bad("act_block: must divide n_heads * head_dim (%u), got %u", c->n_heads * c->head_dim, block);
    if (c->ffn_dim % block) return bad("act_block: must divide ffn_dim (%u), got %u", c->ffn_dim, block);
    c->act_block = block;
    return TL_OK;
}

/* The config fields at header offset 48 .. 183, in versions 2 and 3 184 .. 215, and in version
 * 3 220 .. 235 (core_cycles, attn_gate, loop_window, act_block), checked like
 * ModelConfig.validate(); the header's version (1, 2 or 3, checked) decides which. A version-3
 * file's exit_threshold (offset 216) is read here and checked in step 8, once the tensor set says
 * whether the file has the exit gate (check_exit_threshold). */
static tl_status parse_config(const uint8_t* h, tl_config* c) {
    size_t name_len = 0;
    TRY(check_nul_padded(h + 120, 64, "name", &name_len));
    if (utf8_error(h + 120, name_len) < name_len) return bad("name: not valid UTF-8");
    memset(c, 0, sizeof *c);
    memcpy(c->name, h + 120, name_len);
    c->version = rd_u32(h + 8);
    c->vocab_size = rd_u32(h + 48);
    c->d_model = rd_u32(h + 52);
    c->n_heads = rd_u32(h + 56);
    c->n_kv_heads = rd_u32(h + 60);
    c->head_dim = rd_u32(h + 64);
    c->ffn_dim = rd_u32(h + 68);
    c->n_pre_blocks = rd_u32(h + 72);
    c->default_loops = rd_u32(h + 76);
    c->max_seq_len = rd_u32(h + 80);
    c->weight_format = rd_u32(h + 84);
    c->group_size = rd_u32(h + 88);
    c->tied_head = rd_u32(h + 92);
    c->bos_id = (int32_t)rd_u32(h + 96);
    c->eos_id = (int32_t)rd_u32(h + 100);
    c->tokenizer = rd_u32(h + 104);
    c->rope_theta = rd_f32(h + 108);
    c->rms_eps = rd_f32(h + 112);

    TRY(check_range("vocab_size", c->vocab_size, 2, 1 << 20));
    TRY(check_range("d_model", c->d_model, 1, 1 << 16));
    TRY(check_range("n_heads", c->n_heads, 1, UINT32_MAX));
    TRY(check_range("n_kv_heads", c->n_kv_heads, 1, UINT32_MAX));
    if (c->n_heads % c->n_kv_heads)
        return bad("n_kv_heads: must divide n_heads (%u), got %u", c->n_heads, c->n_kv_heads);
    TRY(check_range("head_dim", c->head_dim, 2, 1024));
    if (c->head_dim % 2) return bad("head_dim: must be even, got %u", c->head_dim);
    if ((uint64_t)c->n_heads * c->head_dim > (1u << 16))
        return bad("n_heads * head_dim: must be <= 65536, got %llu",
                   (unsigned long long)c->n_heads * c->head_dim);
    TRY(check_range("ffn_dim", c->ffn_dim, 1, 1 << 16));
    TRY(check_range("n_pre_blocks", c->n_pre_blocks, 0, 64));
    TRY(check_range("default_loops", c->default_loops, 1, 256));
    TRY(check_range("max_seq_len", c->max_seq_len, 1, 1 << 20));
    if (c->weight_format != TL_FORMAT_INT8 && c->weight_format != TL_FORMAT_INT4)
        return bad("weight_format: must be 1 (int8) or 2 (int4), got %u", c->weight_format);
    if (c->weight_format == TL_FORMAT_INT8) {
        if (c->group_size != 0) return bad("group_size: must be 0 for int8, got %u", c->group_size);
    } else {
        const uint32_t gs = c->group_size;
        TRY(check_range("group_size", gs, 2, UINT32_MAX));
        if (gs % 2) return bad("group_size: must be even for int4, got %u", gs);
        if (c->d_model % gs) return bad("group_size: must divide d_model (%u), got %u", c->d_model, gs);
        if ((c->n_heads * c->head_dim) % gs)
            return bad("group_size: must divide n_heads * head_dim (%u), got %u",
                       c->n_heads * c->head_dim, gs);
        if (c->ffn_dim % gs) return bad("group_size: must divide ffn_dim (%u), got %u", c->ffn_dim, gs);
    }
    TRY(check_flag("tied_head", c->tied_head));
    TRY(check_range("bos_id", c->bos_id, -1, (int64_t)c->vocab_size - 1));
    TRY(check_range("eos_id", c->eos_id, -1, (int64_t)c->vocab_size - 1));
    if (c->tokenizer > TL_TOKENIZER_HF)
        return bad("tokenizer: must be 0 (none), 1 (bytes) or 2 (hf), got %u", c->tokenizer);
    if (c->version == 1 && c->tokenizer == TL_TOKENIZER_HF)
        return bad("tokenizer: 2 (hf) needs a version-2 file, got %u in version 1", c->tokenizer);
    if (c->tokenizer == TL_TOKENIZER_BYTES && c->vocab_size < 256)
        return bad("tokenizer: 'bytes' needs vocab_size >= 256, got %u", c->vocab_size);
    TRY(check_positive("rope_theta", c->rope_theta));
    TRY(check_positive("rms_eps", c->rms_eps));
    if (c->version == 1) { /* the version-2 model a version-1 file describes (§6.5) */
        c->n_core_blocks = 1;
        c->block_layout = TL_LAYOUT_PRE;
        c->embed_scale = 1.0f;
        return TL_OK;
    }
    c->n_core_blocks = rd_u32(h + 184);
    c->n_coda_blocks = rd_u32(h + 188);
    c->block_layout = rd_u32(h + 192);
    c->qkv_bias = rd_u32(h + 196);
    c->injection = rd_u32(h + 200);
    c->step_norm = rd_u32(h + 204);
    c->embed_scale = rd_f32(h + 208);
    c->coda_norm = rd_u32(h + 212);
    if (c->version >= 3) c->exit_threshold = rd_f32(h + 216);
    TRY(check_range("n_core_blocks", c->n_core_blocks, 1, 256));
    TRY(check_range("n_coda_blocks", c->n_coda_blocks, 0, 64));
    if (tl_n_layers(c, c->default_loops) > TL_MAX_CACHE_LAYERS)
        return bad("n_pre_blocks + default_loops * (n_core_blocks + n_coda_blocks): must be <= %d, got %zu",
                   TL_MAX_CACHE_LAYERS, tl_n_layers(c, c->default_loops));
    if (c->block_layout > TL_LAYOUT_POST)
        return bad("block_layout: must be 0 (pre), 1 (sandwich) or 2 (post), got %u", c->block_layout);
    TRY(check_flag("qkv_bias", c->qkv_bias));
    TRY(check_flag("injection", c->injection));
    TRY(check_flag("step_norm", c->step_norm));
    TRY(check_positive("embed_scale", c->embed_scale));
    TRY(check_flag("coda_norm", c->coda_norm));
    if (c->version < 3) return TL_OK;
    TRY(check_core_cycles(c, rd_u32(h + 220)));
    c->attn_gate = rd_u32(h + 224);
    TRY(check_flag("attn_gate", c->attn_gate));
    TRY(check_loop_window(c, rd_u32(h + 228)));
    return check_act_block(c, rd_u32(h + 232));
}

/* ---- the tensor set (docs/spec.md §6.3), in the required order -------------------------- */

/* Where build_views puts a tensor, which also says which value rule it obeys. */
typedef enum target {
    T_EMB_W, T_EMB_S, T_ROPE_COS, T_ROPE_SIN,
    T_LINEAR_W8, T_LINEAR_W4, T_LINEAR_M, T_LINEAR_S, /* of linear `index`        */
    T_QKV_BIAS, T_ATTN_POST_NORM, T_FFN_POST_NORM,    /* of block `index`         */
    T_LOOP_GATE_W, T_LOOP_GATE_S, T_LOOP_GATE_B,      /* of core block `index`    */
    T_STEP_NORM, T_CODA_NORM,
    T_STOP_IDS,                                       /* copied into the config   */
    T_EXIT_GATE_W, T_EXIT_GATE_S, T_EXIT_GATE_B,      /* all three or none        */
    T_META                                            /* checked, then dropped    */
} target;

typedef struct required {
    char name[48];
    uint32_t dtype, ndim;
    uint64_t dims[2]; /* dims[0] == 0: any length (stop_ids, a meta.* text)     */
    target target;
    uint32_t index;   /* the linear or block of the target                      */
    uint32_t cols;    /* K of a linear's tensors                                 */
    int optional;     /* stop_ids, an exit_gate.* tensor or a meta.* text: the
                         file may leave it out (the exit gate's, all three)     */
    int64_t entry;    /* index in the table, -1 until found                      */
} required;

static void add_required(required* r, size_t* n, target tg, uint32_t index, uint32_t dtype,
                         uint64_t d0, uint64_t d1, const char* fmt, ...)
    __attribute__((format(printf, 8, 9)));
static void add_required(required* r, size_t* n, target tg, uint32_t index, uint32_t dtype,
                         uint64_t d0, uint64_t d1, const char* fmt, ...) {
    required* t = &r[(*n)++];
    memset(t, 0, sizeof *t);
    va_list args;
    va_start(args, fmt);
    vsnprintf(t->name, sizeof t->name, fmt, args);
    va_end(args);
    t->dtype = dtype;
    t->ndim = d1 ? 2 : 1;
    t->dims[0] = d0;
    t->dims[1] = d1;
    t->target = tg;
    t->index = index;
    t->entry = -1;
}

/* Linear `index` of tl_file.linears, y[R] from x[K], named by fmt: stored as <name>.w,
 * <name>.m (int4) and <name>.s. */
static void add_linear(const tl_config* c, required* r, size_t* n, size_t index, uint32_t R,
                       uint32_t K, const char* fmt, ...) __attribute__((format(printf, 7, 8)));
static void add_linear(const tl_config* c, required* r, size_t* n, size_t index, uint32_t R,
                       uint32_t K, const char* fmt, ...) {
    char name[40];
    va_list args;
    va_start(args, fmt);
    vsnprintf(name, sizeof name, fmt, args);
    va_end(args);
    const size_t first = *n;
    const uint32_t i = (uint32_t)index;
    if (c->weight_format == TL_FORMAT_INT8) {
        add_required(r, n, T_LINEAR_W8, i, DT_I8, R, K, "%s.w", name);
    } else {
        add_required(r, n, T_LINEAR_W4, i, DT_U8, R, K / 2, "%s.w", name);
        add_required(r, n, T_LINEAR_M, i, DT_U8, R, K / c->group_size, "%s.m", name);
    }
    add_required(r, n, T_LINEAR_S, i, DT_F32, R, 0, "%s.s", name);
    for (size_t k = first; k < *n; k++) r[k].cols = K;
}

/* The entries of tl_file.linears: 4 per block, the adapter's 2 when injection, the head. */
static size_t n_linears_of(const tl_config* c) {
    return (size_t)tl_n_blocks(c) * TL_PARTS + (c->injection ? 2 : 0) + 1;
}

/* The tensor-name prefix of block b (file order): pre.<b>, core.<j>, coda.<c>; version 1's one
 * core block is `loop`. */
static void block_prefix(const tl_config* c, uint32_t b, char* out, size_t size) {
    const uint32_t core = c->n_pre_blocks, coda = core + c->n_core_blocks;
    if (b < core) snprintf(out, size, "pre.%u", b);
    else if (c->version == 1) snprintf(out, size, "loop");
    else if (b < coda) snprintf(out, size, "core.%u", b - core);
    else snprintf(out, size, "coda.%u", b - coda);
}

/* An upper bound on required_tensors' count. */
static size_t max_required(const tl_config* c) {
    const size_t per_block = 3 * TL_PARTS + 6; /* linears as .w .m .s, the bias, two gains, the loop gate */
    return 4 + per_block * tl_n_blocks(c) + 3 * 3 + 2 + 1 + 3 + 3; /* adapter, head; norms;
                                                                     stop ids; gate; texts */
}

/* Fills r (capacity max_required(c)) in the required order, stop_ids, the exit gate and the
 * meta.* texts last; returns the count. */
static size_t required_tensors(const tl_config* c, required* r) {
    const uint32_t V = c->vocab_size, d = c->d_model, D = c->head_dim, F = c->ffn_dim;
    const uint32_t QKV = (uint32_t)tl_qkv_rows(c), HD = c->n_heads * D;
    const int post = c->block_layout != TL_LAYOUT_PRE;
    size_t n = 0;
    add_required(r, &n, T_EMB_W, 0, DT_I8, V, d, "tok_emb.w");
    add_required(r, &n, T_EMB_S, 0, DT_F32, V, 0, "tok_emb.s");
    add_required(r, &n, T_ROPE_COS, 0, DT_F32, c->max_seq_len, D / 2, "rope.cos");
    add_required(r, &n, T_ROPE_SIN, 0, DT_F32, c->max_seq_len, D / 2, "rope.sin");
    for (uint32_t b = 0; b < tl_n_blocks(c); b++) {
        char p[16];
        block_prefix(c, b, p, sizeof p);
        add_linear(c, r, &n, tl_block_linear_index(b, TL_PART_QKV), QKV, d, "%s.attn_qkv", p);
        if (c->qkv_bias) add_required(r, &n, T_QKV_BIAS, b, DT_F32, QKV, 0, "%s.attn_qkv.b", p);
        add_linear(c, r, &n, tl_block_linear_index(b, TL_PART_OUT), d, HD, "%s.attn_out", p);
        if (post) add_required(r, &n, T_ATTN_POST_NORM, b, DT_F32, d, 0, "%s.attn_post_norm", p);
        add_linear(c, r, &n, tl_block_linear_index(b, TL_PART_GATE_UP), 2 * F, d, "%s.ffn_gate_up", p);
        add_linear(c, r, &n, tl_block_linear_index(b, TL_PART_DOWN), d, F, "%s.ffn_down", p);
        if (post) add_required(r, &n, T_FFN_POST_NORM, b, DT_F32, d, 0, "%s.ffn_post_norm", p);
        if (c->loop_window && b >= c->n_pre_blocks && b < c->n_pre_blocks + c->n_core_blocks) {
            /* the loop gate's weights are int8 whatever weight_format */
            add_required(r, &n, T_LOOP_GATE_W, b, DT_I8, c->n_heads, D, "%s.loop_gate.w", p);
            add_required(r, &n, T_LOOP_GATE_S, b, DT_F32, c->n_heads, 0, "%s.loop_gate.s", p);
            add_required(r, &n, T_LOOP_GATE_B, b, DT_F32, c->n_heads, 0, "%s.loop_gate.b", p);
        }
    }
    if (c->injection) {
        add_linear(c, r, &n, tl_adapter_linear_index(c, 0), d, d, "core.adapter_state");
        add_linear(c, r, &n, tl_adapter_linear_index(c, 1), d, d, "core.adapter_inject");
    }
    if (c->step_norm) add_required(r, &n, T_STEP_NORM, 0, DT_F32, d, 0, "core.step_norm");
    if (c->coda_norm) add_required(r, &n, T_CODA_NORM, 0, DT_F32, d, 0, "coda.input_norm");
    if (!c->tied_head) add_linear(c, r, &n, n_linears_of(c) - 1, V, d, "head");
    if (c->version >= 3) { /* the exit gate's weights are int8 whatever weight_format */
        add_required(r, &n, T_STOP_IDS, 0, DT_I32, 0, 0, "stop_ids");
        add_required(r, &n, T_EXIT_GATE_W, 0, DT_I8, 1, d, "exit_gate.w");
        add_required(r, &n, T_EXIT_GATE_S, 0, DT_F32, 1, 0, "exit_gate.s");
        add_required(r, &n, T_EXIT_GATE_B, 0, DT_F32, 1, 0, "exit_gate.b");
        for (size_t k = n - 4; k < n; k++) r[k].optional = 1;
    }
    if (c->version >= 2) { /* the texts, of any length; meta.tokenizer_json exactly when hf */
        add_required(r, &n, T_META, 0, DT_U8, 0, 0, "meta.architecture");
        r[n - 1].optional = 1;
        add_required(r, &n, T_META, 0, DT_U8, 0, 0, "meta.tokenizer_config");
        r[n - 1].optional = 1;
        if (c->tokenizer == TL_TOKENIZER_HF)
            add_required(r, &n, T_META, 0, DT_U8, 0, 0, "meta.tokenizer_json");
    }
    return n;
}

/* ---- tensor table ------------------------------------------------------------------------ */

typedef struct entry {
    char name[49];
    uint32_t dtype, ndim;
    uint64_t dims[MAX_NDIM];
    uint64_t offset, end;
    size_t index;
} entry;

/* The table as parsed, and once read, each tensor's private copy. */
typedef struct table {
    size_t n;
    entry* entries;    /* [n], in table order                                    */
    entry** by_offset; /* [n], in file order: the order the tensors are read     */
    uint8_t** data;    /* [n]: entry i's bytes (tl_alloc), owned until build_views */
} table;

static void table_free(table* t) {
    for (size_t i = 0; t->data && i < t->n; i++) tl_free(t->data[i]);
    tl_free(t->data);
    tl_free(t->by_offset);
    tl_free(t->entries);
    memset(t, 0, sizeof *t);
}

static int by_name(const void* a, const void* b) {
    const entry* x = *(const entry* const*)a;
    const entry* y = *(const entry* const*)b;
    int c = strcmp(x->name, y->name);
    return c ? c : (x->index > y->index) - (x->index < y->index);
}

static int by_span(const void* a, const void* b) {
    const entry* x = *(const entry* const*)a;
    const entry* y = *(const entry* const*)b;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return strcmp(x->name, y->name);
}

static const char* dtype_name(uint32_t code) {
    return code == DT_F32 ? "float32" : code == DT_I8 ? "int8" : code == DT_U8 ? "uint8" : "int32";
}

static size_t dtype_bytes(uint32_t code) { return code == DT_F32 || code == DT_I32 ? 4 : 1; }

/* Entry i: name, dtype, ndim, dims, alignment and bounds. dup marks a name seen earlier. */
static tl_status parse_entry(const uint8_t* raw, size_t i, uint64_t data_offset,
                             uint64_t file_bytes, int dup, entry* e) {
    char what[64];
    size_t len = 0;
    snprintf(what, sizeof what, "tensor %zu name", i);
    TRY(check_nul_padded(raw, 48, what, &len));
    for (size_t k = 0; k < len; k++)
        if (raw[k] < 0x20 || raw[k] > 0x7e) return bad("tensor %zu name: not printable ASCII", i);
    if (dup) return bad("tensor %zu '%s': duplicate name", i, e->name);
    e->dtype = rd_u32(raw + 48);
    e->ndim = rd_u32(raw + 52);
    for (int k = 0; k < MAX_NDIM; k++) e->dims[k] = rd_u64(raw + 56 + 8 * k);
    e->offset = rd_u64(raw + 88);
    if (e->dtype < DT_F32 || e->dtype > DT_I32)
        return bad("tensor %zu '%s': dtype code must be 1, 2, 3 or 4, got %u", i, e->name, e->dtype);
    if (e->ndim < 1 || e->ndim > MAX_NDIM)
        return bad("tensor %zu '%s': ndim must be 1 .. %d, got %u", i, e->name, MAX_NDIM, e->ndim);
    for (uint32_t k = 0; k < MAX_NDIM; k++)
        if ((k < e->ndim) ? e->dims[k] < 1 : e->dims[k] != 0)
            return bad("tensor %zu '%s': dims must be >= 1 for the first %u and 0 after", i,
                       e->name, e->ndim);
    if (e->offset % ALIGN)
        return bad("tensor %zu '%s': offset %llu not a multiple of %d", i, e->name,
                   (unsigned long long)e->offset, ALIGN);
    if (e->offset < data_offset)
        return bad("tensor %zu '%s': offset %llu < data_offset %llu", i, e->name,
                   (unsigned long long)e->offset, (unsigned long long)data_offset);
    /* nbytes = prod(dims) * itemsize, overflow-checked; beyond file_bytes is enough to fail */
    uint64_t nbytes = dtype_bytes(e->dtype), limit = file_bytes;
    int past_end = 0;
    for (uint32_t k = 0; k < e->ndim && !past_end; k++) {
        if (nbytes > limit / e->dims[k]) past_end = 1;
        else nbytes *= e->dims[k];
    }
    if (past_end || e->offset > file_bytes || nbytes > file_bytes - e->offset)
        return bad("tensor %zu '%s': data runs past the end of the file (%llu bytes)", i, e->name,
                   (unsigned long long)file_bytes);
    e->end = e->offset + nbytes;
    return TL_OK;
}

/* Table bounds, every entry (read from the file here), and overlaps. On success t holds the
 * n entries in both orders, with no data yet. */
static tl_status parse_table(reader* r, uint64_t file_bytes, uint64_t n_tensors, uint64_t table_offset,
                             uint64_t data_offset, table* t) {
    if (table_offset != HEADER_BYTES)
        return bad("table_offset: must be %d, got %llu", HEADER_BYTES, (unsigned long long)table_offset);
    const uint64_t table_end = table_offset + ENTRY_BYTES * n_tensors; /* n_tensors < 2^32 */
    if (table_end > file_bytes)
        return bad("tensor table: %llu entries end at byte %llu, past the end of the file (%llu bytes)",
                   (unsigned long long)n_tensors, (unsigned long long)table_end,
                   (unsigned long long)file_bytes);
    if (data_offset % ALIGN)
        return bad("data_offset: must be a multiple of %d, got %llu", ALIGN, (unsigned long long)data_offset);
    if (data_offset < table_end)
        return bad("data_offset: must be >= %llu (end of the tensor table), got %llu",
                   (unsigned long long)table_end, (unsigned long long)data_offset);
    const size_t n = (size_t)n_tensors;
    t->n = n;
    t->entries = tl_alloc_zeroed(n ? n : 1, sizeof(entry));
    t->by_offset = tl_alloc_zeroed(n ? n : 1, sizeof(entry*));
    t->data = tl_alloc_zeroed(n ? n : 1, sizeof(uint8_t*));
    uint8_t* raw = tl_alloc(n ? ENTRY_BYTES * n : 1);
    uint8_t* dup = tl_alloc_zeroed(n ? n : 1, 1);
    entry** order = t->by_offset;
    tl_status st = TL_OK;
    if (!t->entries || !t->by_offset || !t->data || !raw || !dup) {
        st = tl_fail_oom("tensor table");
        goto done;
    }
    st = read_kept(r, raw, ENTRY_BYTES * n);
    if (st != TL_OK) goto done;
    /* duplicates: sort by (name, index); every later member of a run is a duplicate */
    for (size_t i = 0; i < n; i++) {
        memcpy(t->entries[i].name, raw + ENTRY_BYTES * i, 48); /* entries[i].name[48] stays 0 */
        t->entries[i].index = i;
        order[i] = &t->entries[i];
    }
    qsort(order, n, sizeof *order, by_name);
    for (size_t i = 1; i < n; i++)
        if (strcmp(order[i]->name, order[i - 1]->name) == 0) dup[order[i]->index] = 1;
    for (size_t i = 0; i < n && st == TL_OK; i++)
        st = parse_entry(raw + ENTRY_BYTES * i, i, data_offset, file_bytes, dup[i], &t->entries[i]);
    if (st != TL_OK) goto done;
    qsort(order, n, sizeof *order, by_span);
    for (size_t i = 1; i < n; i++)
        if (order[i]->offset < order[i - 1]->end) {
            st = bad("tensors '%s' and '%s' overlap", order[i - 1]->name, order[i]->name);
            goto done;
        }
done:
    tl_free(raw);
    tl_free(dup);
    return st;
}

/* The rest of the file, in file order: each tensor of t into its own allocation (t->data),
 * the bytes between them summed only. t == NULL: every byte summed only. */
static tl_status read_tensors(reader* r, table* t) {
    for (size_t k = 0; t && k < t->n; k++) {
        const entry* e = t->by_offset[k];
        TRY(read_skipped(r, e->offset - r->pos));
        uint8_t* data = tl_alloc((size_t)(e->end - e->offset));
        if (!data) return tl_fail_oom("tensor data");
        t->data[e->index] = data;
        TRY(read_kept(r, data, e->end - e->offset));
    }
    return read_skipped(r, r->size - r->pos);
}

/* ---- the tensor set and values --------------------------------------------------------- */

static int by_required_name(const void* a, const void* b) {
    return strcmp(((const required*)a)->name, ((const required*)b)->name);
}

static int is_exit_gate(target tg) {
    return tg == T_EXIT_GATE_W || tg == T_EXIT_GATE_S || tg == T_EXIT_GATE_B;
}

/* Every entry must be required or optional, with the right dtype and shape; then every
 * required one present, and the exit gate's three tensors when one is (c->exit_gate is set
 * then). `sorted` is a name-sorted copy of `req` used for lookups. */
static tl_status check_layout(const table* t, tl_config* c, required* req, size_t n_req, required* sorted) {
    memcpy(sorted, req, n_req * sizeof *req);
    qsort(sorted, n_req, sizeof *sorted, by_required_name);
    for (size_t i = 0; i < t->n; i++) {
        const entry* e = &t->entries[i];
        required key;
        memcpy(key.name, e->name, sizeof key.name);
        key.name[47] = 0; /* names are NUL-terminated within 48 bytes (checked) */
        required* r = bsearch(&key, sorted, n_req, sizeof *sorted, by_required_name);
        if (!r) return bad("unexpected tensor '%s'", e->name);
        if (r->dtype != e->dtype)
            return bad("tensor '%s': dtype %s != expected %s", e->name, dtype_name(e->dtype),
                       dtype_name(r->dtype));
        int same = e->ndim == r->ndim;
        for (uint32_t k = 0; same && k < r->ndim; k++) same = !r->dims[k] || e->dims[k] == r->dims[k];
        if (!same) return bad("tensor '%s': shape does not match the config", e->name);
        r->entry = (int64_t)i;
        if (is_exit_gate(r->target)) c->exit_gate = 1;
    }
    for (size_t i = 0; i < n_req; i++) {
        required key = req[i];
        const required* r = bsearch(&key, sorted, n_req, sizeof *sorted, by_required_name);
        if (r->entry < 0 && (!r->optional || (c->exit_gate && is_exit_gate(r->target))))
            return bad("missing tensor '%s'", req[i].name);
        req[i].entry = r->entry;
    }
    return TL_OK;
}

/* The rule every f32 of a tensor obeys, or NULL for a tensor that is not checked value by
 * value (weights, multipliers, texts). */
static const char* f32_rule(target tg) {
    switch (tg) {
    case T_EMB_S:
    case T_LINEAR_S:
    case T_EXIT_GATE_S:
    case T_LOOP_GATE_S: return "scales must be finite and >= 0";
    case T_ROPE_COS:
    case T_ROPE_SIN: return "values must be finite with |v| <= 1";
    case T_QKV_BIAS:
    case T_ATTN_POST_NORM:
    case T_FFN_POST_NORM:
    case T_STEP_NORM:
    case T_CODA_NORM:
    case T_EXIT_GATE_B:
    case T_LOOP_GATE_B: return "values must be finite"; /* biases and gains */
    default: return NULL;
    }
}

static int f32_ok(target tg, float v) {
    if (!isfinite(v)) return 0;
    if (tg == T_EMB_S || tg == T_LINEAR_S || tg == T_EXIT_GATE_S || tg == T_LOOP_GATE_S) return v >= 0;
    if (tg == T_ROPE_COS || tg == T_ROPE_SIN) return fabsf(v) <= 1;
    return 1;
}

/* stop_ids' values (docs/spec.md §6.3): at most TL_MAX_STOP_IDS ids, each a token id, none
 * repeated or equal to eos_id. */
static tl_status check_stop_ids(const tl_config* c, const uint8_t* data, uint64_t n) {
    if (n > TL_MAX_STOP_IDS)
        return bad("tensor 'stop_ids': at most %d ids, got %llu", TL_MAX_STOP_IDS, (unsigned long long)n);
    for (uint64_t k = 0; k < n; k++) {
        const int32_t id = (int32_t)rd_u32(data + 4 * k);
        if (id < 0 || (uint32_t)id >= c->vocab_size)
            return bad("tensor 'stop_ids': ids must be in 0 .. %u, found %d", c->vocab_size - 1, id);
        if (id == c->eos_id) return bad("tensor 'stop_ids': ids must differ from eos_id, found %d", id);
        for (uint64_t j = 0; j < k; j++)
            if ((int32_t)rd_u32(data + 4 * j) == id)
                return bad("tensor 'stop_ids': ids must not repeat, found %d twice", id);
    }
    return TL_OK;
}

/* The value rules, on the tensors' copies: the required tensors (and stop_ids, the exit gate)
 * in the required order, then the meta.* texts in table order. */
static tl_status check_values(const table* t, const tl_config* c, const required* req, size_t n_req) {
    for (size_t i = 0; i < n_req; i++) {
        if (req[i].target == T_META || req[i].entry < 0) continue;
        const entry* e = &t->entries[req[i].entry];
        const uint64_t count = (e->end - e->offset) / dtype_bytes(e->dtype);
        const uint8_t* data = t->data[req[i].entry];
        if (req[i].target == T_STOP_IDS) TRY(check_stop_ids(c, data, count));
        const char* rule = f32_rule(req[i].target);
        for (uint64_t k = 0; rule && k < count; k++) {
            const float v = rd_f32(data + 4 * k);
            if (!f32_ok(req[i].target, v)) return bad("tensor '%s': %s, found %g", e->name, rule, (double)v);
        }
        if (req[i].target == T_LINEAR_M) {
            uint64_t m = 0;
            for (uint64_t k = 0; k < count; k++)
                if (data[k] > m) m = data[k];
            const uint64_t K = req[i].cols;
            if (127u * 8u * K * m > 2147483647u)
                return bad("tensor '%s': int4 accumulator bound broken: 127 * 8 * K * max(m) = "
                           "127 * 8 * %llu * %llu > 2^31 - 1", e->name, (unsigned long long)K,
                           (unsigned long long)m);
        }
    }
    for (size_t i = 0; i < t->n; i++) {
        const entry* e = &t->entries[i];
        if (strncmp(e->name, "meta.", 5) != 0) continue; /* only the texts are scanned */
        const size_t len = (size_t)(e->end - e->offset), at = utf8_error(t->data[i], len);
        if (at < len) return bad("tensor '%s': not valid UTF-8 (byte %zu)", e->name, at);
    }
    return TL_OK;
}

/* ---- views -------------------------------------------------------------------------------- */

/* Move the copy of required tensor r out of the table. */
static const void* take(table* t, const required* r) {
    uint8_t* data = t->data[r->entry];
    t->data[r->entry] = NULL;
    return data;
}

/* Put the copy of tensor r where its target says in f. */
static void place(table* t, const required* r, tl_file* f) {
    switch (r->target) {
    case T_EMB_W: f->emb_w = take(t, r); break;
    case T_EMB_S: f->emb_s = take(t, r); break;
    case T_ROPE_COS: f->rope_cos = take(t, r); break;
    case T_ROPE_SIN: f->rope_sin = take(t, r); break;
    case T_LINEAR_W8: f->linears[r->index].w8 = take(t, r); break;
    case T_LINEAR_W4: f->linears[r->index].w4 = take(t, r); break;
    case T_LINEAR_M: f->linears[r->index].mult = take(t, r); break;
    case T_LINEAR_S: {
        tl_linear_src* L = &f->linears[r->index];
        L->scale = take(t, r);
        L->rows = (uint32_t)r->dims[0];
        L->cols = r->cols;
        L->group_size = f->cfg.weight_format == TL_FORMAT_INT4 ? f->cfg.group_size : 0;
        break;
    }
    case T_QKV_BIAS: f->blocks[r->index].qkv_bias = take(t, r); break;
    case T_ATTN_POST_NORM: f->blocks[r->index].attn_post_norm = take(t, r); break;
    case T_FFN_POST_NORM: f->blocks[r->index].ffn_post_norm = take(t, r); break;
    case T_LOOP_GATE_W: f->blocks[r->index].loop_gate_w = take(t, r); break;
    case T_LOOP_GATE_S: f->blocks[r->index].loop_gate_s = take(t, r); break;
    case T_LOOP_GATE_B: f->blocks[r->index].loop_gate_b = take(t, r); break;
    case T_STEP_NORM: f->step_norm = take(t, r); break;
    case T_CODA_NORM: f->coda_norm = take(t, r); break;
    case T_STOP_IDS: {
        const entry* e = &t->entries[r->entry];
        f->cfg.n_stop_ids = (uint32_t)((e->end - e->offset) / 4);
        for (uint32_t k = 0; k < f->cfg.n_stop_ids; k++)
            f->cfg.stop_ids[k] = (int32_t)rd_u32(t->data[r->entry] + 4 * k);
        break; /* the copy is freed with the table */
    }
    case T_EXIT_GATE_W: f->exit_gate_w = take(t, r); break;
    /* the gate's scale and bias are read out; their copies are freed with the table */
    case T_EXIT_GATE_S: f->exit_gate_s = rd_f32(t->data[r->entry]); break;
    case T_EXIT_GATE_B: f->exit_gate_b = rd_f32(t->data[r->entry]); break;
    case T_META: break; /* not kept: freed with the table */
    }
}

static tl_status build_views(table* t, const required* req, size_t n_req, tl_file* f) {
    const tl_config* c = &f->cfg;
    f->n_linears = n_linears_of(c);
    f->linears = tl_alloc_zeroed(f->n_linears, sizeof *f->linears);
    f->blocks = tl_alloc_zeroed(tl_n_blocks(c), sizeof *f->blocks);
    if (!f->linears || !f->blocks) return tl_fail_oom("tensor views");
    for (size_t i = 0; i < n_req; i++)
        if (req[i].entry >= 0) place(t, &req[i], f);
    if (c->tied_head) {
        tl_linear_src* head = &f->linears[f->n_linears - 1];
        head->rows = c->vocab_size;
        head->cols = c->d_model;
        head->w8 = f->emb_w;
        head->scale = f->emb_s;
    }
    return TL_OK;
}

/* ---- entry point ---------------------------------------------------------------------------- */

/* The structure, which says where the bytes go: the config, the table (read here) and the
 * tensor set. On success *req (owned) holds the *n_req required and optional tensors, each
 * with its entry (-1: an optional one the file leaves out). */
static tl_status parse_structure(reader* r, const uint8_t* h, tl_config* c, table* t, required** req,
                                 size_t* n_req) {
    TRY(parse_config(h, c));
    TRY(parse_table(r, r->size, rd_u32(h + 28), rd_u64(h + 32), rd_u64(h + 40), t));
    const size_t cap = max_required(c);
    *req = tl_alloc_zeroed(2 * cap, sizeof **req);
    if (!*req) return tl_fail_oom("required tensor list");
    *n_req = required_tensors(c, *req);
    return check_layout(t, c, *req, *n_req, *req + cap);
}

/* exit_threshold (docs/spec.md §6.1, step 8 of §6.3): 0 (all four bytes zero) without the
 * exit gate, else a finite float in (0, 1]. Always 0 before version 3 (reserved bytes). */
static tl_status check_exit_threshold(const tl_config* c) {
    const float q = c->exit_threshold;
    if (!c->exit_gate && (q != 0 || signbit(q)))
        return bad("exit_threshold: must be 0 without an exit gate, got %g", (double)q);
    if (c->exit_gate && !(isfinite(q) && q > 0 && q <= 1))
        return bad("exit_threshold: must be a finite float in (0, 1] with an exit gate, got %g", (double)q);
    return TL_OK;
}

static tl_status validate(reader* r, tl_file* f) {
    const uint64_t size = r->size;
    if (size < HEADER_BYTES)
        return bad("file too small: %llu bytes < %d-byte header", (unsigned long long)size, HEADER_BYTES);
    uint8_t h[HEADER_BYTES];
    TRY(read_header(r, h));
    if (memcmp(h, "TINYLOOP", 8) != 0) return bad("bad magic, expected \"TINYLOOP\"");
    const uint32_t version = rd_u32(h + 8);
    if (version < 1 || version > 3) return bad("version: unsupported %u, expected 1, 2 or 3", version);
    if (rd_u32(h + 12) != HEADER_BYTES)
        return bad("header_bytes: must be %d, got %u", HEADER_BYTES, rd_u32(h + 12));
    const uint64_t file_bytes = rd_u64(h + 16);
    if (file_bytes != size)
        return bad("file_bytes: header says %llu, file has %llu bytes", (unsigned long long)file_bytes,
                   (unsigned long long)size);

    table t = {0};
    required* req = NULL;
    size_t n_req = 0;
    tl_status st = parse_structure(r, h, &f->cfg, &t, &req, &n_req);
    /* The checksum rule comes before the structure's but needs every byte: read the rest, then
     * report the structure's broken rule, kept aside, only if the checksum holds. */
    char broken[512] = ""; /* as long as tl_last_error()'s buffer */
    if (st == TL_ERR_BAD_FILE) snprintf(broken, sizeof broken, "%s", tl_last_error());
    if (st == TL_OK || st == TL_ERR_BAD_FILE) {
        const tl_status io = read_tensors(r, st == TL_OK ? &t : NULL);
        if (io != TL_OK) st = io;
        else if (r->crc != rd_u32(h + CHECKSUM_AT))
            st = bad("checksum mismatch: header 0x%08x, computed 0x%08x", rd_u32(h + CHECKSUM_AT), r->crc);
        else if (st != TL_OK) st = tl_fail(st, "%s", broken);
    }
    if (st == TL_OK) st = check_values(&t, &f->cfg, req, n_req);
    if (st == TL_OK) st = check_exit_threshold(&f->cfg);
    /* version 1 reserves the version-2 fields, version 2 exit_threshold, core_cycles, attn_gate,
     * loop_window and act_block */
    const int reserved_from = version == 1 ? 184 : version == 2 ? 216 : 236;
    for (int k = reserved_from; st == TL_OK && k < HEADER_BYTES; k++)
        if (h[k]) st = bad("reserved: header bytes %d .. %d must be zero", reserved_from, HEADER_BYTES - 1);
    if (st == TL_OK && rd_u32(h + 116) != 0) st = bad("flags: must be 0, got %u", rd_u32(h + 116));
    if (st == TL_OK) st = build_views(&t, req, n_req, f);
    if (st == TL_OK) {
        f->checksum = rd_u32(h + CHECKSUM_AT);
        f->file_bytes = file_bytes;
    }
    table_free(&t);
    tl_free(req);
    return st;
}

tl_status tl_file_open(const char* path, tl_file* out) {
    memset(out, 0, sizeof *out);
    if (!path) return tl_fail(TL_ERR_INVALID_ARGUMENT, "model path is NULL");
    /* O_NONBLOCK: opening a FIFO must not wait for a writer (it is then refused below); it
     * changes nothing for regular files. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return tl_fail(TL_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return tl_fail(TL_ERR_IO, "cannot read '%s': not a regular file", path);
    }
    (void)posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL); /* a hint for the one front-to-back read */
    reader r = {fd, path, (uint64_t)sb.st_size, 0, 0, NULL};
    tl_status st = validate(&r, out);
    tl_free(r.scratch);
    close(fd);
    if (st != TL_OK) tl_file_close(out);
    return st;
}

/* ---- ownership ------------------------------------------------------------------------------ */

static int is_tied_head(const tl_file* f, size_t i) { return f->cfg.tied_head && i + 1 == f->n_linears; }

static size_t held(const void* p) { return p ? tl_alloc_size(p) : 0; }

void tl_file_release_linear(tl_file* f, size_t i) {
    if (is_tied_head(f, i)) return;
    tl_linear_src* L = &f->linears[i];
    tl_free((void*)L->w8);
    tl_free((void*)L->w4);
    tl_free((void*)L->mult);
    tl_free((void*)L->scale);
    L->w8 = NULL;
    L->w4 = L->mult = NULL;
    L->scale = NULL;
}

/* The vectors the file holds besides the linears: each block's, the step and coda norms, the
 * exit gate's weights. */
static size_t vector_bytes(const tl_file* f) {
    size_t bytes = held(f->step_norm) + held(f->coda_norm) + held(f->exit_gate_w);
    for (uint32_t b = 0; f->blocks && b < tl_n_blocks(&f->cfg); b++) {
        const tl_block_vectors* v = &f->blocks[b];
        bytes += held(v->qkv_bias) + held(v->attn_post_norm) + held(v->ffn_post_norm) + held(v->loop_gate_w) +
                 held(v->loop_gate_s) + held(v->loop_gate_b);
    }
    return bytes;
}

size_t tl_file_held_bytes(const tl_file* f) {
    size_t bytes = held(f->emb_w) + held(f->emb_s) + held(f->rope_cos) + held(f->rope_sin) + vector_bytes(f);
    for (size_t i = 0; f->linears && i < f->n_linears; i++) {
        const tl_linear_src* L = &f->linears[i];
        if (!is_tied_head(f, i)) bytes += held(L->w8) + held(L->w4) + held(L->mult) + held(L->scale);
    }
    return bytes;
}

void tl_file_close(tl_file* f) {
    for (size_t i = 0; f->linears && i < f->n_linears; i++) tl_file_release_linear(f, i);
    tl_free(f->linears);
    for (uint32_t b = 0; f->blocks && b < tl_n_blocks(&f->cfg); b++) {
        tl_free((void*)f->blocks[b].qkv_bias);
        tl_free((void*)f->blocks[b].attn_post_norm);
        tl_free((void*)f->blocks[b].ffn_post_norm);
        tl_free((void*)f->blocks[b].loop_gate_w);
        tl_free((void*)f->blocks[b].loop_gate_s);
        tl_free((void*)f->blocks[b].loop_gate_b);
    }
    tl_free(f->blocks);
    tl_free((void*)f->step_norm);
    tl_free((void*)f->coda_norm);
    tl_free((void*)f->exit_gate_w);
    tl_free((void*)f->emb_w);
    tl_free((void*)f->emb_s);
    tl_free((void*)f->rope_cos);
    tl_free((void*)f->rope_sin);
    memset(f, 0, sizeof *f);
}
