//! How keys, values and bounds cross the command line: parsed from UTF-8 text or, with `--hex`,
//! from hexadecimal; printed as text when that is unambiguous, otherwise as `0x`-prefixed hex.
//! Nothing here touches a store.

use anyhow::{bail, Context};

/// Turns a command-line argument into bytes: its UTF-8 text, or with `hex` its hexadecimal
/// digits (an optional `0x` prefix, an even number of digits, either case).
pub fn parse_arg(text: &str, hex: bool, what: &str) -> anyhow::Result<Vec<u8>> {
    if hex {
        decode_hex(text).with_context(|| format!("{what} `{text}` is not valid hex"))
    } else {
        Ok(text.as_bytes().to_vec())
    }
}

/// Decodes hexadecimal digits, with or without a `0x` prefix.
pub fn decode_hex(text: &str) -> anyhow::Result<Vec<u8>> {
    let digits = text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")).unwrap_or(text);
    if digits.len() & 1 == 1 {
        bail!("odd number of hex digits");
    }
    let nibble = |c: u8| -> anyhow::Result<u8> {
        match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            b'A'..=b'F' => Ok(c - b'A' + 10),
            _ => bail!("`{}` is not a hex digit", char::from(c)),
        }
    };
    digits
        .as_bytes()
        .chunks_exact(2)
        .map(|pair| match pair {
            [high, low] => Ok(nibble(*high)? << 4 | nibble(*low)?),
            _ => bail!("odd number of hex digits"),
        })
        .collect()
}

/// Lower-case hex with a `0x` prefix.
pub fn encode_hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(2 + bytes.len() * 2);
    out.push_str("0x");
    for byte in bytes {
        out.push_str(&format!("{byte:02x}"));
    }
    out
}

/// Bytes for printing: the text itself when it is valid UTF-8 with no control characters and
/// does not itself start with `0x` (so it cannot be mistaken for hex or break a line), otherwise
/// `0x`-prefixed hex.
pub fn display_bytes(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(text) if !text.chars().any(char::is_control) && !text.starts_with("0x") => text.to_string(),
        _ => encode_hex(bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_text_and_hex() {
        assert_eq!(parse_arg("héllo", false, "key").unwrap(), "héllo".as_bytes());
        assert_eq!(parse_arg("00ff10", true, "key").unwrap(), [0x00, 0xff, 0x10]);
        assert_eq!(parse_arg("0xAbCd", true, "key").unwrap(), [0xab, 0xcd]);
        assert_eq!(parse_arg("", true, "key").unwrap(), Vec::<u8>::new());
    }

    #[test]
    fn rejects_bad_hex() {
        assert!(parse_arg("abc", true, "key").is_err());
        assert!(parse_arg("zz", true, "key").is_err());
        let err = format!("{:#}", parse_arg("0xg0", true, "value").unwrap_err());
        assert!(err.contains("value `0xg0` is not valid hex"), "{err}");
    }

    #[test]
    fn displays_text_or_hex() {
        assert_eq!(display_bytes(b"alice"), "alice");
        assert_eq!(display_bytes(b""), "");
        assert_eq!(display_bytes(&[0xff, 0x00]), "0xff00");
        assert_eq!(display_bytes(b"tab\there"), "0x7461620968657265");
        assert_eq!(display_bytes(b"0x12"), "0x30783132");
    }

    #[test]
    fn hex_round_trips() {
        let bytes: Vec<u8> = (0..=255).collect();
        assert_eq!(decode_hex(&encode_hex(&bytes)).unwrap(), bytes);
    }
}
