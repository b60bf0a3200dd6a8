/* weights_info.c -- read a safetensors file (an artifact's weights.safetensors, or any file
 * mhagen.save_weights or the safetensors package wrote) in plain C, no library.
 *
 *   cc -O2 -std=c11 examples/c_app/weights_info.c -o weights_info
 *   ./weights_info DIR/weights.safetensors              # one line per tensor
 *   ./weights_info DIR/weights.safetensors w_o w_o.bin  # also writes w_o's raw bytes
 *
 * The format: 8 bytes, the header's length N (little-endian uint64); N bytes of JSON, an
 * object of "name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]} (offsets
 * from the end of the header) and maybe "__metadata__": {string: string}; then the tensors'
 * raw little-endian bytes. The parser below reads just that subset of JSON. */
#include <ctype.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DIMS 8

typedef struct {
  char name[256], dtype[16];
  int ndim;
  long long shape[MAX_DIMS], begin, end;
} entry;

typedef struct {
  const char *p, *end;
} cursor;

static int fail(const char *what, const char *path) {
  fprintf(stderr, "weights_info: %s: %s\n", path, what);
  return 1;
}

static void ws(cursor *c) {
  while (c->p < c->end && isspace((unsigned char)*c->p)) c->p++;
}

static int expect(cursor *c, char ch) {
  ws(c);
  if (c->p >= c->end || *c->p != ch) return 0;
  c->p++;
  return 1;
}

/* A JSON string without escapes other than \" and \\ (names are plain). */
static int string(cursor *c, char *out, size_t cap) {
  size_t n = 0;
  if (!expect(c, '"')) return 0;
  while (c->p < c->end && *c->p != '"') {
    if (*c->p == '\\' && c->p + 1 < c->end) c->p++;
    if (n + 1 < cap) out[n++] = *c->p;
    c->p++;
  }
  out[n] = '\0';
  return c->p < c->end && *c->p++ == '"';
}

static int integer(cursor *c, long long *out) {
  char *stop;
  ws(c);
  errno = 0;
  *out = strtoll(c->p, &stop, 10);
  if (stop == c->p || errno || stop > c->end) return 0;
  c->p = stop;
  return 1;
}

/* [int, int, ...] into out (at most cap); returns the count, -1 on error. */
static int int_list(cursor *c, long long *out, int cap) {
  int n = 0;
  if (!expect(c, '[')) return -1;
  if (expect(c, ']')) return 0;
  do {
    if (n == cap || !integer(c, &out[n++])) return -1;
  } while (expect(c, ','));
  return expect(c, ']') ? n : -1;
}

/* One tensor's object, or the metadata's (strings only, skipped). */
static int object(cursor *c, entry *e) {
  char key[64], skip[4096];
  long long offsets[2];
  int got = 0;
  if (!expect(c, '{')) return 0;
  if (expect(c, '}')) return e == NULL;
  do {
    if (!string(c, key, sizeof key) || !expect(c, ':')) return 0;
    if (e == NULL) {
      if (!string(c, skip, sizeof skip)) return 0;
    } else if (strcmp(key, "dtype") == 0) {
      if (!string(c, e->dtype, sizeof e->dtype)) return 0;
      got |= 1;
    } else if (strcmp(key, "shape") == 0) {
      if ((e->ndim = int_list(c, e->shape, MAX_DIMS)) < 0) return 0;
      got |= 2;
    } else if (strcmp(key, "data_offsets") == 0) {
      if (int_list(c, offsets, 2) != 2) return 0;
      e->begin = offsets[0], e->end = offsets[1];
      got |= 4;
    } else {
      return 0;
    }
  } while (expect(c, ','));
  return expect(c, '}') && (e == NULL || got == 7);
}

int main(int argc, char **argv) {
  if (argc != 2 && argc != 4) {
    fprintf(stderr, "usage: %s FILE.safetensors [NAME OUTPUT.bin]\n", argv[0]);
    return 2;
  }
  const char *path = argv[1];
  FILE *f = fopen(path, "rb");
  if (f == NULL) return fail(strerror(errno), path);
  unsigned char len8[8];
  if (fseek(f, 0, SEEK_END) != 0) return fail("cannot seek", path);
  const long long size = ftell(f);
  rewind(f);
  if (fread(len8, 1, 8, f) != 8) return fail("shorter than the 8-byte header length", path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | len8[i];
  if (n > (uint64_t)(size - 8) || n > 100u << 20) return fail("header longer than the file", path);
  char *header = malloc(n + 1);
  if (header == NULL || fread(header, 1, n, f) != n) return fail("cannot read the header", path);
  header[n] = '\0';
  const long long data_start = 8 + (long long)n, data_size = size - data_start;
  cursor c = {header, header + n};
  char name[256];
  int found = 0, count = 0;
  if (!expect(&c, '{')) return fail("the header is not a JSON object", path);
  if (!expect(&c, '}')) do {
    entry e;
    memset(&e, 0, sizeof e);
    if (!string(&c, name, sizeof name) || !expect(&c, ':'))
      return fail("malformed header", path);
    if (strcmp(name, "__metadata__") == 0) {
      if (!object(&c, NULL)) return fail("malformed __metadata__", path);
      continue;
    }
    if (!object(&c, &e)) return fail("malformed tensor entry", path);
    if (e.begin < 0 || e.begin > e.end || e.end > data_size)
      return fail("a tensor's data_offsets lie outside the file", path);
    strcpy(e.name, name);
    printf("%s %s [", e.name, e.dtype);
    for (int i = 0; i < e.ndim; ++i) printf(i ? ", %lld" : "%lld", e.shape[i]);
    printf("] %lld bytes at %lld\n", e.end - e.begin, data_start + e.begin);
    count++;
    if (argc == 4 && strcmp(e.name, argv[2]) == 0) {   /* copy its bytes out */
      FILE *out = fopen(argv[3], "wb");
      char buf[1 << 16];
      if (out == NULL) return fail(strerror(errno), argv[3]);
      if (fseek(f, data_start + e.begin, SEEK_SET) != 0) return fail("cannot seek", path);
      for (long long left = e.end - e.begin; left > 0;) {
        const size_t k = left < (long long)sizeof buf ? (size_t)left : sizeof buf;
        if (fread(buf, 1, k, f) != k || fwrite(buf, 1, k, out) != k)
          return fail("cannot copy the tensor", argv[3]);
        left -= (long long)k;
      }
      if (fclose(out) != 0) return fail("cannot write", argv[3]);
      found = 1;
    }
  } while (expect(&c, ','));
  if (!expect(&c, '}')) return fail("malformed header (no closing brace)", path);
  if (argc == 4 && !found) return fail("no such tensor", argv[2]);
  fprintf(stderr, "%d tensors, %lld data bytes\n", count, data_size);
  free(header);
  fclose(f);
  return 0;
}
