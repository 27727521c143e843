//! Block digests of a prompt's token IDs: the keys router replicas share through a
//! state store (`kvroute.fleet.shared.digests`, whose NumPy `block_digests` is the
//! reference this must equal bit for bit: every router, old or new, on any host, has to
//! compute the same digests).
//!
//! Block `i` (`DIGEST_BLOCK` tokens) is digested as `mix(sum_j t[j] * MULT[j])`
//! (wrapping u64 arithmetic), `mix` being splitmix64's finaliser and `MULT[j] =
//! mix((j + 1) * 0x9E3779B97F4A7C15) | 1`. A partial last block has no digest. Each
//! digest becomes two u32 tree keys, low half first (the little-endian view NumPy gives).

/// Tokens per digested block (`kvroute.fleet.shared.digests.BLOCK_SIZE`).
pub const DIGEST_BLOCK: usize = 16;

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's finaliser.
#[inline]
const fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

const fn multipliers() -> [u64; DIGEST_BLOCK] {
    let mut out = [0u64; DIGEST_BLOCK];
    let mut j = 0;
    while j < DIGEST_BLOCK {
        out[j] = mix(((j as u64) + 1).wrapping_mul(GOLDEN)) | 1;
        j += 1;
    }
    out
}

const MULT: [u64; DIGEST_BLOCK] = multipliers();

/// The digest of one whole block.
#[inline]
pub fn block_digest(block: &[u32]) -> u64 {
    debug_assert_eq!(block.len(), DIGEST_BLOCK);
    let mut sum = 0u64;
    for (&t, &m) in block.iter().zip(MULT.iter()) {
        sum = sum.wrapping_add(u64::from(t).wrapping_mul(m));
    }
    mix(sum)
}

/// Two u32 keys per whole block of `tokens` (low half of the digest first).
pub fn block_digest_keys(tokens: &[u32]) -> Vec<u32> {
    let blocks = tokens.chunks_exact(DIGEST_BLOCK);
    let mut out = Vec::with_capacity(2 * blocks.len());
    for block in blocks {
        let d = block_digest(block);
        out.push(d as u32);
        out.push((d >> 32) as u32);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_to_the_numpy_reference() {
        // kvroute.fleet.shared.digests.block_digests(np.arange(40, dtype=np.uint32) * 7919)
        // viewed as uint32: two whole blocks, the last 8 tokens left out.
        let tokens: Vec<u32> = (0..40u32).map(|i| i * 7919).collect();
        assert_eq!(
            block_digest_keys(&tokens),
            vec![1_679_395_972, 878_047_519, 3_311_233_750, 2_142_389_386]
        );
    }

    #[test]
    fn a_partial_block_has_no_digest_and_blocks_do_not_chain() {
        let tokens: Vec<u32> = (0..(3 * DIGEST_BLOCK as u32 + 5)).collect();
        let keys = block_digest_keys(&tokens);
        assert_eq!(keys.len(), 6);
        assert_eq!(
            block_digest_keys(&tokens[..DIGEST_BLOCK]),
            keys[..2].to_vec()
        );
        let mut other = tokens.clone();
        other[DIGEST_BLOCK] += 1; // block 1 changes, blocks 0 and 2 do not
        let changed = block_digest_keys(&other);
        assert_eq!(changed[..2], keys[..2]);
        assert_ne!(changed[2..4], keys[2..4]);
        assert_eq!(changed[4..], keys[4..]);
        assert!(block_digest_keys(&tokens[..DIGEST_BLOCK - 1]).is_empty());
    }
}
