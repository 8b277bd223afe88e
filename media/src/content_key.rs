//! Content hashes of encoded media and the radix-cache keys of a media span.
//!
//! Session memory keys its radix tree with `u64` elements (DESIGN §4): text tokens are
//! their ids widened to `u64`; a media span of `num_tokens` `<|media_pad|>` positions is
//! keyed by values derived from the hash of the media's encoded bytes, so the same
//! picture at the same place hits the cache and a different picture with the same
//! placeholder ids does not.
//!
//! - [`content_hash`] is SipHash-2-4 (Aumasson & Bernstein, 2012) over the encoded bytes
//!   with the fixed key [`CONTENT_HASH_KEY`] (`"caracal-"`, `"media-v1"` read as
//!   little-endian `u64`s). It is stable across processes, platforms and Rust releases
//!   (unlike `std`'s `DefaultHasher`), so keys can be logged and compared.
//! - With a public key, anyone can craft two inputs with equal hashes. A server whose
//!   cache is shared between mutually untrusted clients should use
//!   [`content_hash_keyed`] with a secret key drawn at startup: a crafted collision could
//!   otherwise make one client's request reuse KV computed for another client's image.
//! - [`placeholder_keys`] turns a hash into one key per placeholder position. Every key
//!   has the top bit ([`MEDIA_KEY_BIT`]) set, so it can never equal a text token id (all
//!   vocabularies are far below 2^63), and the remaining 63 bits are a bijective mix of
//!   `(hash, num_tokens, position)`, so keys within a span are distinct and spans of
//!   different media share no key except with probability ~n²/2^63.
//!
//! The keys identify the bytes, not the preprocessing: one radix tree serves one model
//! with one processor config. Mixing `num_tokens` in means the same bytes under a config
//! that yields a different token count also get different keys.

/// The fixed SipHash key of [`content_hash`]: the ASCII of `"caracal-"` and `"media-v1"`,
/// little-endian.
pub const CONTENT_HASH_KEY: [u64; 2] = [
    u64::from_le_bytes(*b"caracal-"),
    u64::from_le_bytes(*b"media-v1"),
];

/// Top bit set on every media placeholder key; text token ids never have it.
pub const MEDIA_KEY_BIT: u64 = 1 << 63;

/// Stable 64-bit hash of encoded media bytes: SipHash-2-4 keyed with [`CONTENT_HASH_KEY`].
pub fn content_hash(bytes: &[u8]) -> u64 {
    content_hash_keyed(bytes, CONTENT_HASH_KEY)
}

/// SipHash-2-4 of `bytes` under a caller-chosen 128-bit key (`[k0, k1]`); use a secret
/// key when cache entries are shared between untrusted clients.
pub fn content_hash_keyed(bytes: &[u8], key: [u64; 2]) -> u64 {
    let mut v = [
        key[0] ^ 0x736f_6d65_7073_6575,
        key[1] ^ 0x646f_7261_6e64_6f6d,
        key[0] ^ 0x6c79_6765_6e65_7261,
        key[1] ^ 0x7465_6462_7974_6573,
    ];
    let mut words = bytes.chunks_exact(8);
    for word in &mut words {
        let m = u64::from_le_bytes(word.try_into().expect("chunks_exact yields 8 bytes"));
        v[3] ^= m;
        sip_round(&mut v);
        sip_round(&mut v);
        v[0] ^= m;
    }
    // Last block: the remaining bytes, little-endian, with the length's low byte on top.
    let mut last = (bytes.len() as u64) << 56;
    for (i, &b) in words.remainder().iter().enumerate() {
        last |= u64::from(b) << (8 * i);
    }
    v[3] ^= last;
    sip_round(&mut v);
    sip_round(&mut v);
    v[0] ^= last;
    v[2] ^= 0xff;
    for _ in 0..4 {
        sip_round(&mut v);
    }
    v[0] ^ v[1] ^ v[2] ^ v[3]
}

/// One SipRound.
fn sip_round(v: &mut [u64; 4]) {
    v[0] = v[0].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(13) ^ v[0];
    v[0] = v[0].rotate_left(32);
    v[2] = v[2].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(16) ^ v[2];
    v[0] = v[0].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(21) ^ v[0];
    v[2] = v[2].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(17) ^ v[2];
    v[2] = v[2].rotate_left(32);
}

/// SplitMix64's finaliser: a bijection on `u64` with full avalanche.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The radix-cache key elements of a media span: `num_tokens` values, one per
/// `<|media_pad|>` position, each `MEDIA_KEY_BIT | (mix64(base + i) >> 1)` with
/// `base = mix64(hash ^ mix64(num_tokens))`.
pub fn placeholder_keys(hash: u64, num_tokens: usize) -> Vec<u64> {
    let base = mix64(hash ^ mix64(num_tokens as u64));
    (0..num_tokens as u64)
        .map(|i| MEDIA_KEY_BIT | (mix64(base.wrapping_add(i)) >> 1))
        .collect()
}

/// Whether a radix key element belongs to a media span (as opposed to a text token id).
pub fn is_media_key(key: u64) -> bool {
    key & MEDIA_KEY_BIT != 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// The key `00 01 02 .. 0f` of the SipHash paper's test vectors.
    const PAPER_KEY: [u64; 2] = [0x0706_0504_0302_0100, 0x0f0e_0d0c_0b0a_0908];

    #[test]
    fn siphash_matches_the_reference_vectors() {
        // Aumasson & Bernstein, "SipHash: a fast short-input PRF", appendix A: the
        // 15-byte message 00..0e gives a129ca6149be45e5; the empty message 726fdb47dd0e0e31.
        let message: Vec<u8> = (0..15).collect();
        assert_eq!(
            content_hash_keyed(&message, PAPER_KEY),
            0xa129_ca61_49be_45e5
        );
        assert_eq!(content_hash_keyed(&[], PAPER_KEY), 0x726f_db47_dd0e_0e31);
    }

    #[test]
    #[allow(deprecated)] // std's SipHasher is SipHash-2-4 and serves only as an oracle here.
    fn siphash_matches_std_siphasher_for_every_length() {
        use std::hash::Hasher;
        let data: Vec<u8> = (0..300u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
            .collect();
        for len in 0..data.len() {
            let mut oracle =
                std::hash::SipHasher::new_with_keys(CONTENT_HASH_KEY[0], CONTENT_HASH_KEY[1]);
            oracle.write(&data[..len]);
            assert_eq!(content_hash(&data[..len]), oracle.finish(), "length {len}");
        }
    }

    #[test]
    fn content_hash_is_pinned() {
        // Pinned so that a change of key or algorithm (which would orphan logged or
        // persisted keys) fails loudly.
        assert_eq!(
            CONTENT_HASH_KEY,
            [0x2d6c_6163_6172_6163, 0x3176_2d61_6964_656d]
        );
        assert_eq!(content_hash(b"caracal"), 0x7222_600a_cc70_1476);
        assert_ne!(content_hash(b"caracal"), content_hash(b"caracal "));
    }

    #[test]
    fn placeholder_keys_are_media_tagged_distinct_and_deterministic() {
        let hash = content_hash(b"a picture");
        let keys = placeholder_keys(hash, 10_000);
        assert_eq!(keys.len(), 10_000);
        assert!(keys.iter().all(|&k| is_media_key(k)));
        assert_eq!(
            keys.iter().collect::<HashSet<_>>().len(),
            keys.len(),
            "keys within a span are distinct"
        );
        assert_eq!(placeholder_keys(hash, 10_000), keys, "deterministic");
        assert!(
            !is_media_key(163_605),
            "a text token id (<|media_pad|>) is not a media key"
        );
        assert!(placeholder_keys(hash, 0).is_empty());
    }

    #[test]
    fn different_media_or_token_counts_share_no_keys() {
        let a = placeholder_keys(content_hash(b"picture A"), 4096);
        let b = placeholder_keys(content_hash(b"picture B"), 4096);
        let a_set: HashSet<_> = a.iter().collect();
        assert!(b.iter().all(|k| !a_set.contains(k)));
        // Same bytes, different processor token count: the spans differ from the first key.
        let c = placeholder_keys(content_hash(b"picture A"), 4200);
        assert_ne!(a[0], c[0]);
    }
}
