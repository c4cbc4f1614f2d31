//! Bounds on what one decoded message may hold, enforced while decoding:
//! a peer's announced element count is checked before anything is
//! allocated for it, so a small frame cannot turn into a huge structure.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserialize, Deserializer, SeqAccess, Visitor};

/// Most requests one transfer request (and so one reply) may name.
pub const MAX_REQUESTS_PER_TRANSFER: usize = 16 * 1024;
/// Most blocks one request may name (a 2-million-token prompt of 16-token blocks).
pub const MAX_BLOCKS_PER_REQUEST: usize = 128 * 1024;
/// Most regions a cache may register.
pub const MAX_REGIONS: usize = 64 * 1024;
/// Most bytes of an id (request or engine) or of a reason text.
pub const MAX_TEXT_LEN: usize = 1024;

struct BoundedVec<T, const MAX: usize>(PhantomData<T>);

impl<'de, T: Deserialize<'de>, const MAX: usize> Visitor<'de> for BoundedVec<T, MAX> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a sequence of at most {MAX} elements")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
        let announced = seq.size_hint().unwrap_or(0);
        if announced > MAX {
            return Err(de::Error::invalid_length(announced, &self));
        }
        let mut out = Vec::with_capacity(announced.min(4096));
        while let Some(item) = seq.next_element()? {
            if out.len() == MAX {
                return Err(de::Error::invalid_length(MAX + 1, &self));
            }
            out.push(item);
        }
        Ok(out)
    }
}

/// Deserializes a `Vec` of at most `MAX` elements (`deserialize_with`).
pub(crate) fn vec<'de, D: Deserializer<'de>, T: Deserialize<'de>, const MAX: usize>(d: D) -> Result<Vec<T>, D::Error> {
    d.deserialize_seq(BoundedVec::<T, MAX>(PhantomData))
}

struct BoundedText;

impl BoundedText {
    fn check<E: de::Error>(s: &str) -> Result<(), E> {
        if s.len() > MAX_TEXT_LEN {
            return Err(E::invalid_length(s.len(), &BoundedText));
        }
        Ok(())
    }
}

impl Visitor<'_> for BoundedText {
    type Value = String;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "at most {MAX_TEXT_LEN} bytes of text")
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<String, E> {
        Self::check(s)?;
        Ok(s.to_owned())
    }

    fn visit_string<E: de::Error>(self, s: String) -> Result<String, E> {
        Self::check(&s)?;
        Ok(s)
    }
}

/// Deserializes a `String` of at most [`MAX_TEXT_LEN`] bytes
/// (`deserialize_with`). It asks for a borrowed `str`, so a decoder reading
/// from a slice (the side channel's, see `codec.rs`) checks the claimed
/// length against the bytes actually there before anything is allocated,
/// and this checks the bound before the text is copied.
pub(crate) fn text<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    d.deserialize_str(BoundedText)
}

/// `text` cut to at most [`MAX_TEXT_LEN`] bytes on a character boundary (what
/// we send is bounded like what we accept).
pub fn bounded_text(text: &str) -> String {
    let mut end = text.len().min(MAX_TEXT_LEN);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.get(..end).unwrap_or_default().to_owned()
}
