// Streaming read bandwidth: T threads each sum their share of a large buffer
// (far larger than the caches), best of several passes. This is the ceiling
// for LLM decode, which streams every weight once per generated token.
//
// Build: cc -O3 -mavx2 -mfma -pthread bench/membw.c -o bench/.work/membw
// Usage: membw THREADS [MiB=1024] [PASSES=7]   -> prints "<GB/s>" (1 GB = 1e9 B)
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef struct {
    const __m256i *p;
    size_t n;  // 32-byte vectors
    uint64_t sink;
} job_t;

static void *run(void *arg) {
    job_t *j = (job_t *)arg;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    const __m256i *p = j->p;
    for (size_t i = 0; i + 4 <= j->n; i += 4) {
        a0 = _mm256_add_epi64(a0, _mm256_load_si256(p + i));
        a1 = _mm256_add_epi64(a1, _mm256_load_si256(p + i + 1));
        a2 = _mm256_add_epi64(a2, _mm256_load_si256(p + i + 2));
        a3 = _mm256_add_epi64(a3, _mm256_load_si256(p + i + 3));
    }
    a0 = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    uint64_t out[4];
    _mm256_storeu_si256((__m256i *)out, a0);
    j->sink = out[0] + out[1] + out[2] + out[3];
    return NULL;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    size_t mib = argc > 2 ? (size_t)atol(argv[2]) : 1024;
    int passes = argc > 3 ? atoi(argv[3]) : 7;
    if (threads < 1 || threads > 256) return 2;
    size_t bytes = mib << 20;
    uint8_t *buf = aligned_alloc(64, bytes);
    if (!buf) return 1;
    // Fault every page in before timing, with distinct contents: identical
    // pages may be merged by the host (KSM), and reads of one shared page
    // would come from cache.
    uint64_t *w = (uint64_t *)buf, x = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < bytes / 8; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        w[i] = x;
    }
    size_t vecs = bytes / 32, per = vecs / threads / 4 * 4;
    double best = 0;
    uint64_t sink = 0;
    for (int k = 0; k < passes; k++) {
        pthread_t tid[256];
        job_t jobs[256];
        double t0 = now();
        for (int t = 0; t < threads; t++) {
            jobs[t] = (job_t){(const __m256i *)buf + t * per, per, 0};
            pthread_create(&tid[t], NULL, run, &jobs[t]);
        }
        for (int t = 0; t < threads; t++) {
            pthread_join(tid[t], NULL);
            sink += jobs[t].sink;
        }
        double gbs = (double)(per * threads * 32) / (now() - t0) / 1e9;
        if (gbs > best) best = gbs;
    }
    printf("%.2f\n", best);
    fprintf(stderr, "membw: %d threads, %zu MiB, best of %d passes (checksum %llu)\n", threads, mib, passes,
            (unsigned long long)sink);
    free(buf);
    return 0;
}
