/* test_pool.c — the process-wide worker crew behind every model's tl_pool (cpu/threadpool.h):
 * every item runs exactly once; worker indices stay below the share's thread count and are
 * unique among the calls running at once; a share never gets more threads than it asked for,
 * even when the crew is larger; a caller that finds the crew busy runs its job itself without
 * waiting; many callers hammering the crew at once (the TSan run's workload); idle workers
 * use no CPU. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "cpu/threadpool.h"
#include "test_util.h"

enum { MAX_ITEMS = 4096 };

static void pause_us(long us) {
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

static double cpu_seconds(void) {
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return (double)(r.ru_utime.tv_sec + r.ru_stime.tv_sec) + 1e-6 * (double)(r.ru_utime.tv_usec + r.ru_stime.tv_usec);
}

static void raise_to(atomic_int* max, int x) {
    for (int m = atomic_load(max); x > m && !atomic_compare_exchange_weak(max, &m, x);) {
    }
}

/* A job that records who ran each item and how many ran at once. */
typedef struct census {
    atomic_int runs[MAX_ITEMS];
    atomic_int busy[TL_POOL_MAX_THREADS]; /* per worker index: calls running now */
    atomic_int running, max_running, max_worker, clashes;
    int wait_for;                         /* each item waits until this many have run at once... */
    long wait_us;                         /* ...or this long has passed (us)             */
} census;

static void census_item(void* ctx, size_t item, unsigned worker) {
    census* c = ctx;
    atomic_fetch_add(&c->runs[item], 1);
    if (atomic_fetch_add(&c->busy[worker], 1) != 0) atomic_fetch_add(&c->clashes, 1);
    const int now = atomic_fetch_add(&c->running, 1) + 1;
    raise_to(&c->max_running, now);
    raise_to(&c->max_worker, (int)worker);
    for (long waited = 0; waited < c->wait_us && atomic_load(&c->max_running) < c->wait_for; waited += 100)
        pause_us(100);
    atomic_fetch_sub(&c->running, 1);
    atomic_fetch_sub(&c->busy[worker], 1);
}

static census* census_run(tl_pool* pool, size_t n_items, int wait_for, long wait_us) {
    static census c;
    memset(&c, 0, sizeof c);
    c.wait_for = wait_for;
    c.wait_us = wait_us;
    tl_pool_run(pool, n_items, census_item, &c);
    int once = 1;
    for (size_t i = 0; i < n_items; i++) once &= atomic_load(&c.runs[i]) == 1;
    CHECK(once, "%zu items: some item did not run exactly once", n_items);
    CHECK(atomic_load(&c.clashes) == 0, "two calls shared a worker index");
    return &c;
}

static void test_shares(void) {
    tl_pool* big = NULL;
    tl_pool* small = NULL;
    tl_pool* single = NULL;
    CHECK_OK(tl_pool_create(7, &big)); /* the crew now has at least 6 workers */
    CHECK_OK(tl_pool_create(3, &small));
    CHECK_OK(tl_pool_create(1, &single));
    CHECK(tl_pool_threads(big) == 7 && tl_pool_threads(small) == 3 && tl_pool_threads(single) == 1, "threads");
    const size_t sizes[] = {1, 2, 3, 17, 1000, MAX_ITEMS};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        census* c = census_run(big, sizes[i], 0, 0);
        CHECK(atomic_load(&c->max_worker) < 7, "big share: worker %d", atomic_load(&c->max_worker));
        c = census_run(small, sizes[i], 0, 0);
        CHECK(atomic_load(&c->max_worker) < 3, "share of 3: worker %d", atomic_load(&c->max_worker));
        c = census_run(single, sizes[i], 0, 0);
        CHECK(atomic_load(&c->max_worker) == 0, "share of 1: worker %d", atomic_load(&c->max_worker));
    }
    /* three items that wait for each other: a share of 3 runs them at once, as workers 0, 1, 2 */
    census* c = census_run(small, 3, 3, 2000 * 1000);
    CHECK(atomic_load(&c->max_running) == 3 && atomic_load(&c->max_worker) == 2,
          "share of 3: %d items at once, top worker %d", atomic_load(&c->max_running), atomic_load(&c->max_worker));
    /* items that wait for a fourth thread (100 ms each) never get one */
    c = census_run(small, 4, 4, 100 * 1000);
    CHECK(atomic_load(&c->max_running) <= 3, "share of 3 ran %d items at once", atomic_load(&c->max_running));
    tl_pool_destroy(single);
    tl_pool_destroy(small);
    tl_pool_destroy(big);
}

/* Job A's items wait until job B, submitted from another thread while A holds the crew, has
 * finished: B must not wait for A, so it runs inline, every item as worker 0. */
typedef struct busy_case {
    tl_pool* pool;
    atomic_bool a_started, b_done;
    atomic_int b_max_worker;
    atomic_int b_items;
} busy_case;

static void a_item(void* ctx, size_t item, unsigned worker) {
    (void)item, (void)worker;
    busy_case* bc = ctx;
    atomic_store(&bc->a_started, true);
    for (int i = 0; i < 20000 && !atomic_load(&bc->b_done); i++) pause_us(100); /* 2 s at most */
}

static void b_item(void* ctx, size_t item, unsigned worker) {
    (void)item;
    busy_case* bc = ctx;
    atomic_fetch_add(&bc->b_items, 1);
    raise_to(&bc->b_max_worker, (int)worker);
}

static void* submit_b(void* arg) {
    busy_case* bc = arg;
    while (!atomic_load(&bc->a_started)) pause_us(100);
    tl_pool_run(bc->pool, 64, b_item, bc);
    atomic_store(&bc->b_done, true);
    return NULL;
}

static void test_busy_runs_inline(void) {
    busy_case bc;
    memset(&bc, 0, sizeof bc);
    CHECK_OK(tl_pool_create(3, &bc.pool));
    pthread_t b;
    pthread_create(&b, NULL, submit_b, &bc);
    tl_pool_run(bc.pool, 4, a_item, &bc);
    pthread_join(b, NULL);
    CHECK(atomic_load(&bc.b_done), "job B waited for job A");
    CHECK(atomic_load(&bc.b_items) == 64 && atomic_load(&bc.b_max_worker) == 0, "job B: %d items, worker %d",
          atomic_load(&bc.b_items), atomic_load(&bc.b_max_worker));
    tl_pool_destroy(bc.pool);
}

/* Four threads with shares of different sizes run many small jobs at once. */
typedef struct sum_job {
    uint32_t in[512];
    uint32_t out[512];
} sum_job;

static void square_item(void* ctx, size_t item, unsigned worker) {
    (void)worker;
    sum_job* j = ctx;
    j->out[item] = j->in[item] * j->in[item];
}

static void* hammer(void* arg) {
    const unsigned threads = *(const unsigned*)arg;
    tl_pool* pool = NULL;
    CHECK_OK(tl_pool_create(threads, &pool));
    static _Thread_local sum_job j;
    int bad = 0;
    for (uint32_t round = 0; round < 300 && pool; round++) {
        const size_t n = 1 + (round * 37 + threads) % 512;
        for (size_t i = 0; i < n; i++) j.in[i] = round + (uint32_t)i;
        tl_pool_run(pool, n, square_item, &j);
        for (size_t i = 0; i < n; i++) bad |= j.out[i] != j.in[i] * j.in[i];
    }
    CHECK(!bad, "share of %u: wrong results", threads);
    tl_pool_destroy(pool);
    return NULL;
}

static void test_many_callers(void) {
    unsigned threads[4] = {2, 3, 4, 7};
    pthread_t t[4];
    for (int i = 0; i < 4; i++) pthread_create(&t[i], NULL, hammer, &threads[i]);
    for (int i = 0; i < 4; i++) pthread_join(t[i], NULL);
}

/* After the jobs above the crew has six or more workers; idle, they must sleep. Only the crew's
 * threads run while this thread sleeps, so the process's CPU time over the sleep is theirs. The
 * bound is generous (each worker may spin ~50 us before it sleeps): a busy-waiting crew uses
 * about a core per worker. */
static void test_idle_uses_no_cpu(void) {
    tl_pool* pool = NULL;
    CHECK_OK(tl_pool_create(7, &pool));
    census_run(pool, 1000, 0, 0);
    const double before = cpu_seconds();
    pause_us(300 * 1000);
    const double used = cpu_seconds() - before;
    printf("idle crew: %.1f ms CPU over a 300 ms sleep\n", used * 1e3);
    CHECK(used < 0.030, "idle workers used %.1f ms of CPU over 300 ms", used * 1e3);
    tl_pool_destroy(pool);
}

int main(void) {
    tl_pool* pool = NULL;
    CHECK_STATUS(tl_pool_create(TL_POOL_MAX_THREADS + 1, &pool), TL_ERR_INVALID_ARGUMENT);
    CHECK(pool == NULL, "no share on failure");
    test_shares();
    test_busy_runs_inline();
    test_many_callers();
    test_idle_uses_no_cpu();
    return tu_finish("test_pool");
}
