/* rdmig-verify: the lab guest's memory verifier (tools/guest/build-guest.sh packs it, static).
 *
 * After a post-copy switch the target runs the guest, so no dump of the source can be compared
 * with it. This program makes the guest's memory prove itself instead: it fills MIB MiB with
 * self-describing pages, keeps rewriting them at RATE MiB/s (the dirtying that keeps pre-copy
 * from converging), and checks every page again and again. A page holds
 *   magic, its page number, its generation (how often it was written), a checksum of the rest,
 *   and 4064 bytes that are a function of (page number, generation);
 * the expected generation of every page is kept in a separate table. A page that arrived stale
 * (an older generation), torn, or from another page, or a table page that did, is a mismatch.
 *
 * Console (CONSOLE, e.g. /dev/ttyS0), one line a second:
 *   rdmig-verify-counter N checked=PAGES scans=FULL_SCANS writes=PAGE_WRITES mismatches=M
 * and one line per mismatch (the first 50):
 *   rdmig-verify-mismatch page=P want_gen=G got_page=Q got_gen=H magic=0|1 sum=0|1
 *
 * Usage: rdmig-verify MIB RATE_MIB CONSOLE
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096u
#define WORDS (PAGE / 8u)
#define HEADER 4u
#define MAGIC 0x7264696776657279ull /* "rdigvery" */

static int con = 2;

static void say(const char *line) {
  size_t n = strlen(line);
  while (n > 0) {
    ssize_t w = write(con, line, n);
    if (w <= 0) return;
    line += w;
    n -= (size_t)w;
  }
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static uint64_t body_word(uint64_t page, uint64_t gen, uint64_t i) {
  uint64_t x = page * 0x9E3779B97F4A7C15ull ^ gen * 0xC2B2AE3D27D4EB4Full ^ i * 0x165667B19E3779F9ull;
  x ^= x >> 29;
  return x;
}

static uint64_t checksum(const uint64_t *w) {
  uint64_t s = 0;
  for (uint64_t i = HEADER; i < WORDS; ++i) s = ((s << 7) | (s >> 57)) ^ w[i];
  return s;
}

static void write_page(uint64_t *w, uint64_t page, uint64_t gen) {
  for (uint64_t i = HEADER; i < WORDS; ++i) w[i] = body_word(page, gen, i);
  w[0] = MAGIC;
  w[1] = page;
  w[2] = gen;
  w[3] = checksum(w);
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: rdmig-verify MIB RATE_MIB CONSOLE\n");
    return 2;
  }
  const uint64_t pages = strtoull(argv[1], NULL, 10) * (1024u * 1024u / PAGE);
  const double rate_pages = strtod(argv[2], NULL) * (1024.0 * 1024.0 / PAGE);
  int fd = open(argv[3], O_WRONLY | O_NOCTTY);
  if (fd >= 0) con = fd;
  if (pages == 0) return 2;
  uint64_t *mem = mmap(NULL, pages * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  uint64_t *want = mmap(NULL, pages * 8, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (mem == MAP_FAILED || want == MAP_FAILED) {
    say("rdmig-verify-error mmap failed\n");
    return 1;
  }
  for (uint64_t p = 0; p < pages; ++p) {
    want[p] = 1;
    write_page(mem + p * WORDS, p, 1);
  }
  char line[256];
  snprintf(line, sizeof line, "rdmig-verify ready pages=%llu rate_pages=%.0f\n", (unsigned long long)pages, rate_pages);
  say(line);
  uint64_t counter = 0, checked = 0, scans = 0, writes = 0, mismatches = 0;
  uint64_t wcur = 0, ccur = 0;
  const double start = now_s();
  double next_report = start + 1.0;
  double owed = 0, last = start;
  for (;;) {
    const double t = now_s();
    /* The writer: rate_pages a second, round robin over the whole region. */
    owed += (t - last) * rate_pages;
    last = t;
    if (owed > (double)pages) owed = (double)pages;
    while (owed >= 1.0) {
      const uint64_t g = want[wcur] + 1;
      write_page(mem + wcur * WORDS, wcur, g);
      want[wcur] = g;
      ++writes;
      owed -= 1.0;
      if (++wcur == pages) wcur = 0;
    }
    /* The checker: 64 pages a turn, every page in turn. */
    for (int k = 0; k < 64; ++k) {
      const uint64_t *w = mem + ccur * WORDS;
      const int magic_ok = w[0] == MAGIC;
      const int sum_ok = w[3] == checksum(w);
      if (!magic_ok || !sum_ok || w[1] != ccur || w[2] != want[ccur]) {
        if (++mismatches <= 50) {
          snprintf(line, sizeof line, "rdmig-verify-mismatch page=%llu want_gen=%llu got_page=%llu got_gen=%llu magic=%d sum=%d\n",
                   (unsigned long long)ccur, (unsigned long long)want[ccur], (unsigned long long)w[1],
                   (unsigned long long)w[2], magic_ok, sum_ok);
          say(line);
        }
        /* Rewrite it so that one bad page is counted once, not on every scan. */
        write_page(mem + ccur * WORDS, ccur, want[ccur]);
      }
      ++checked;
      if (++ccur == pages) {
        ccur = 0;
        ++scans;
      }
    }
    if (t >= next_report) {
      next_report = t + 1.0;
      snprintf(line, sizeof line, "rdmig-verify-counter %llu checked=%llu scans=%llu writes=%llu mismatches=%llu\n",
               (unsigned long long)++counter, (unsigned long long)checked, (unsigned long long)scans,
               (unsigned long long)writes, (unsigned long long)mismatches);
      say(line);
    }
  }
}
