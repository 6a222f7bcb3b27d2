# Edit lists (fuzz_checkpoint's input: 4-byte little-endian offset, 1 byte to
# XOR) that give one dataset of a checkpoint a declared shape of 2^40 elements
# per dimension more, with its object header's checksum recomputed so that
# HDF5 opens the result: what a 2^40-element dataset declared in a small file
# looks like to the reader (issue 35).  usage: shape_seed.py FILE RANK OUT
import struct, sys

def lookup3(k):  # Jenkins' hashlittle, HDF5's metadata checksum
    def rot(x, r): return ((x << r) | (x >> (32 - r))) & 0xffffffff
    n = len(k); a = b = c = (0xdeadbeef + n) & 0xffffffff; i = 0
    def w(j): return struct.unpack_from('<I', bytes(k[j:j + 4]).ljust(4, b'\0'))[0]
    while n > 12:
        a = (a + w(i)) & 0xffffffff; b = (b + w(i + 4)) & 0xffffffff; c = (c + w(i + 8)) & 0xffffffff
        a = (a - c) & 0xffffffff; a ^= rot(c, 4); c = (c + b) & 0xffffffff
        b = (b - a) & 0xffffffff; b ^= rot(a, 6); a = (a + c) & 0xffffffff
        c = (c - b) & 0xffffffff; c ^= rot(b, 8); b = (b + a) & 0xffffffff
        a = (a - c) & 0xffffffff; a ^= rot(c, 16); c = (c + b) & 0xffffffff
        b = (b - a) & 0xffffffff; b ^= rot(a, 19); a = (a + c) & 0xffffffff
        c = (c - b) & 0xffffffff; c ^= rot(b, 4); b = (b + a) & 0xffffffff
        n -= 12; i += 12
    if n == 0: return c
    t = bytes(k[i:i + n]).ljust(12, b'\0')
    a = (a + struct.unpack_from('<I', t, 0)[0]) & 0xffffffff
    b = (b + struct.unpack_from('<I', t, 4)[0]) & 0xffffffff
    c = (c + struct.unpack_from('<I', t, 8)[0]) & 0xffffffff
    c ^= b; c = (c - rot(b, 14)) & 0xffffffff; a ^= c; a = (a - rot(c, 11)) & 0xffffffff
    b ^= a; b = (b - rot(a, 25)) & 0xffffffff; c ^= b; c = (c - rot(b, 16)) & 0xffffffff
    a ^= c; a = (a - rot(c, 4)) & 0xffffffff; b ^= a; b = (b - rot(a, 14)) & 0xffffffff
    c ^= b; c = (c - rot(b, 24)) & 0xffffffff
    return c

path, rank, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
img = bytearray(open(path, 'rb').read())
at = img.find(b'OHDR')
while at >= 0:
    flags = img[at + 5]; p = at + 6
    if flags & 0x20: p += 16
    if flags & 0x10: p += 4
    width = 1 << (flags & 3)
    size = int.from_bytes(img[p:p + width], 'little'); p += width
    start, end = p, p + size
    while p + 4 <= end:
        mtype, msize = img[p], struct.unpack_from('<H', img, p + 1)[0]
        body = p + 4 + (2 if flags & 0x04 else 0)
        if mtype == 1 and img[body] == 2 and img[body + 1] == rank and img[body + 3] == 1:
            new = bytearray(img)
            ndims = rank * (2 if img[body + 2] & 1 else 1)  # the maximum dimensions too
            for d in range(ndims):
                new[body + 4 + 8 * d + 5] ^= 0x01  # + 2^40
            struct.pack_into('<I', new, end, lookup3(new[at:end]))
            edits = b''.join(struct.pack('<IB', i, img[i] ^ new[i]) for i in range(len(img)) if img[i] != new[i])
            open(out, 'wb').write(edits)
            sys.exit(0)
        p = body + msize
    at = img.find(b'OHDR', at + 4)
sys.exit("shape_seed.py: no rank-%d dataspace found in %s" % (rank, path))
