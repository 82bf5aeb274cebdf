/* CRC-32 (zlib's: the reflected IEEE polynomial), slicing by eight, for the compiled encoder
 * (events/_speedups.c) and reader (events/log/_sqlite.c), each of which includes this file and
 * so keeps its own table. zlib's own ``crc32`` is built for long buffers: on a log record of a
 * hundred bytes or so its set-up costs as much as the bytes (about 100 ns a record, where this
 * takes under half of it), and it was the encoder's largest single cost in a logged
 * simulation's profile (bench/simulate_bench.py). ``make_crc_table`` runs once, at import. */
#ifndef KVLEDGER_CRC32_H
#define KVLEDGER_CRC32_H

#include <stddef.h>
#include <stdint.h>

static uint32_t crc_table[8][256];
static void make_crc_table(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int t = 1; t < 8; t++)
            crc_table[t][n] = (crc_table[t - 1][n] >> 8) ^ crc_table[0][crc_table[t - 1][n] & 0xFF];
}

static uint32_t record_crc(const unsigned char *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (; n >= 8; n -= 8, p += 8) {
        uint32_t lo = c ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                           (uint32_t)p[3] << 24);
        c = crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF] ^
            crc_table[5][(lo >> 16) & 0xFF] ^ crc_table[4][lo >> 24] ^ crc_table[3][p[4]] ^
            crc_table[2][p[5]] ^ crc_table[1][p[6]] ^ crc_table[0][p[7]];
    }
    while (n--) c = crc_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

#endif
