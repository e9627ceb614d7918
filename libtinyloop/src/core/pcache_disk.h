/* pcache_disk.h — the disk tier of the automatic prefix cache (docs/spec.md §4.3.1): one
 * directory of spilled block files (block_file.h) and an index of the files this tier counts,
 * those it found at open, read (another process's too) or wrote, least recently used first,
 * under a byte budget.
 *
 * Writes go to a temporary file in the directory (".<name>.<pid>.<n>.tmp"), renamed over the
 * name when complete, so a reader (another process too) sees a whole file or none. Reading a
 * file sets its modification time to now and makes it the most recently used. Nothing here
 * fails a request: a file that is missing, cannot be read or written, or breaks a rule of
 * §7.6 is a miss (or a block not spilled); a miss leaves its reason in tl_last_error.
 * Not thread-safe: the prefix cache calls it under its mutex, so all of the tier's file I/O
 * happens with the cache's lock held. */
#ifndef TL_PCACHE_DISK_H
#define TL_PCACHE_DISK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/block_file.h"

typedef struct tl_pdisk tl_pdisk;

/* The tier in directory `dir` (created, one level, when missing; copied) for model m's blocks,
 * with a budget of `budget` bytes (0 = no limit), indexing every *.tlblock file there by
 * modification time. TL_ERR_IO naming the path and the reason when it is not a directory or
 * cannot be created or read; TL_ERR_OUT_OF_MEMORY. */
tl_status tl_pdisk_open(const char* dir, size_t budget, const tl_block_model* m, tl_pdisk** out);
void tl_pdisk_free(tl_pdisk* d); /* NULL: no-op */

/* Write block b, at `at` (its name hash `name`, block_file.h), to its file, unless that file
 * already holds a valid block serving b's layer count (left as it is: checking it is not a
 * use) or the file would be larger than the whole budget; first removes the least recently
 * used files until it fits. True when written. */
bool tl_pdisk_spill(tl_pdisk* d, const tl_block_place* at, uint64_t name, tl_kv_block* b);

/* The block at `at` serving n_layers, read from its file into a new block appended to t (whose
 * positions end at at->index * block_size) as the span of that block's positions; the file
 * becomes the most recently used (joining the index if the tier did not count it). False on a
 * miss, t unchanged. */
bool tl_pdisk_fetch(tl_pdisk* d, const tl_block_place* at, uint64_t name, uint32_t n_layers, tl_kv_table* t);

/* Bytes of the files the tier counts now; its budget (0 = no limit); the model it serves; the
 * spills whose file could not be written (a full disk, an I/O error: the block stays in memory
 * only until evicted). */
size_t tl_pdisk_bytes(const tl_pdisk* d);
size_t tl_pdisk_budget(const tl_pdisk* d);
const tl_block_model* tl_pdisk_model(const tl_pdisk* d);
uint64_t tl_pdisk_failed_writes(const tl_pdisk* d);

#endif
