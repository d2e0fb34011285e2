//! Tests against snapshots saved from real etcd servers (`tests/data/etcd-*.snapshot`, made by
//! `scripts/etcd-snapshot-fixture`: see there for what was written), and damaged copies.

use super::*;
use keeldb::fs::StdFs;

const ETCD_3_6: &[u8] = include_bytes!("../../tests/data/etcd-3.6.16.snapshot");
const ETCD_3_4: &[u8] = include_bytes!("../../tests/data/etcd-3.4.23.snapshot");
const FIXTURES: [(&str, &[u8]); 2] = [("3.6.16", ETCD_3_6), ("3.4.23", ETCD_3_4)];

fn key<'a>(state: &'a EtcdState, k: &str) -> Option<&'a etcd_client::proto::PbKeyValue> {
    state.keys.iter().find(|kv| kv.key == k.as_bytes())
}

/// What the fixture script wrote, as etcd numbered it.
fn check_fixture(version: &str, s: &EtcdState) {
    assert_eq!(s.revision, 131, "{version}");
    assert_eq!(s.compact_revision, 7, "{version}");
    assert_eq!(s.keys.len(), 126, "{version}: /a /big /c /compacted-away /leased/1 /leased/2 and 120 under /many");
    let a = key(s, "/a").unwrap();
    assert_eq!((a.value.as_slice(), a.create_revision, a.mod_revision, a.version), (&b"three"[..], 2, 131, 3));
    assert!(key(s, "/b").is_none(), "{version}: deleted");
    let big = key(s, "/big").unwrap();
    assert_eq!((big.value.len(), big.mod_revision), (6000, 10), "{version}: the value on overflow pages");
    assert_eq!(key(s, "/many/120").map(|kv| kv.value.clone()), Some(b"value-120".to_vec()));
    assert_eq!(s.leases.len(), 1);
    let (lease, ttl) = s.leases[0];
    assert_eq!(ttl, 100_000);
    for k in ["/leased/1", "/leased/2"] {
        assert_eq!(key(s, k).unwrap().lease, lease, "{version}: {k}");
    }
    assert_eq!(key(s, "/a").unwrap().lease, 0);
    assert!(s.auth_enabled);
    let users: Vec<&[u8]> = s.users.iter().map(|u| u.name.as_slice()).collect();
    assert_eq!(users, [&b"alice"[..], b"root"]);
    let reader = s.roles.iter().find(|r| r.name == b"reader").unwrap();
    assert_eq!(reader.key_permission.len(), 2);
}

#[test]
fn snapshots_saved_by_etcd_3_4_and_3_6_read_whole() {
    for (version, file) in FIXTURES {
        let state = read(file).unwrap_or_else(|e| panic!("{version}: {e}"));
        check_fixture(version, &state);
        assert!(state.consistent_index > 0, "{version}");
        // etcd 3.4 keeps no term in `meta`; 3.5 and later do.
        assert_eq!(state.term > 0, version != "3.4.23", "{version}");
    }
}

fn restored(file: &[u8]) -> (tempfile::TempDir, i64) {
    let dir = tempfile::tempdir().unwrap();
    let state = read(file).unwrap();
    let revision = restore(dir.path(), &state, Arc::new(StdFs)).unwrap();
    (dir, revision)
}

fn open(dir: &Path) -> Database {
    Database::open(dir.join("store"), Options::with_durability(Durability::Relaxed)).unwrap()
}

#[test]
fn a_restored_store_holds_keys_leases_users_and_the_revision() {
    let (dir, revision) = restored(ETCD_3_6);
    assert_eq!(revision, 131);
    let db = open(dir.path());
    let txn = db.begin_read().unwrap();
    let a = Record::decode(&txn.get(KV, b"/a").unwrap().unwrap()).unwrap();
    assert_eq!((a.create_revision, a.mod_revision, a.version, a.value.as_slice()), (2, 131, 3, &b"three"[..]));
    assert!(txn.get(KV, b"/b").unwrap().is_none());
    let leases = lease::stored_leases(&txn).unwrap();
    assert_eq!(leases.len(), 1);
    assert_eq!(lease::stored_keys(&txn, leases[0].0).unwrap(), vec![b"/leased/1".to_vec(), b"/leased/2".to_vec()]);
    let auth = AuthState::load(&txn).unwrap();
    assert!(auth.enabled);
    assert_eq!(auth.users["alice"].roles, vec!["reader".to_string()]);
    assert!(auth.is_root("root"));
    // etcd's bcrypt hash came along: the password etcd was given still checks.
    let hash = auth.users["alice"].password_hash.clone().unwrap();
    assert!(bcrypt::verify("alicepw", &hash).unwrap());
    assert!(auth.permitted("alice", b"/many/007", b"", Perm::Read));
    assert!(!auth.permitted("alice", b"/many/007", b"", Perm::Write));
    let rev: i64 = bincode::deserialize(&txn.get(META, REV_KEY).unwrap().unwrap()).unwrap();
    assert_eq!(rev, 131);
}

#[test]
fn an_export_reads_back_as_the_state_it_was_made_from() {
    let (dir, _) = restored(ETCD_3_6);
    let db = open(dir.path());
    let file = export(&db.begin_read().unwrap()).unwrap();
    assert_eq!(file.len() % ALIGN, HASH, "etcdctl's length rule");
    let back = read(&file).unwrap();
    let etcd = read(ETCD_3_6).unwrap();
    assert_eq!(back.keys, etcd.keys);
    assert_eq!(back.leases, etcd.leases);
    assert_eq!(back.revision, etcd.revision);
    assert_eq!(back.compact_revision, etcd.revision, "no history below the revision is exported");
    assert!(back.auth_enabled);
    assert_eq!(back.users.len(), 2);
    let alice = back.users.iter().find(|u| u.name == b"alice").unwrap();
    let etcd_alice = etcd.users.iter().find(|u| u.name == b"alice").unwrap();
    assert_eq!((&alice.password, &alice.roles), (&etcd_alice.password, &etcd_alice.roles));
    let roles = |s: &EtcdState| {
        let mut r: Vec<_> = s.roles.iter().map(|r| (r.name.clone(), r.key_permission.clone())).collect();
        r.sort_by(|a, b| a.0.cmp(&b.0));
        r
    };
    assert_eq!(roles(&back), roles(&etcd));
}

#[test]
fn a_file_without_etcds_hash_is_read_as_a_bare_database() {
    let db = &ETCD_3_6[..ETCD_3_6.len() - HASH];
    check_fixture("3.6.16 bare", &read(db).unwrap());
}

#[test]
fn a_damaged_hash_or_a_truncated_file_is_named() {
    let mut file = ETCD_3_6.to_vec();
    let last = file.len() - 1;
    file[last] ^= 1;
    assert!(matches!(read(&file), Err(Error::HashMismatch)));
    file[last] ^= 1;
    file[100] ^= 1;
    assert!(matches!(read(&file), Err(Error::HashMismatch)));
    // Cut at a page boundary the database reads as bare and misses pages its meta names.
    assert!(matches!(read(&ETCD_3_6[..8192]), Err(Error::Truncated { .. })));
    assert!(matches!(read(b"KEELCKP nothing else"), Err(Error::NotBbolt(_))));
    assert!(matches!(read(&[]), Err(Error::NotBbolt(_))));
}

#[test]
fn a_bbolt_file_that_is_not_etcds_is_refused() {
    let file = bbolt_writer::write(&[(b"other", vec![(b"k".to_vec(), b"v".to_vec())])]).unwrap();
    assert!(matches!(read(&file), Err(Error::MissingBucket("meta"))));
}

/// A deterministic stream of positions and bytes (the seed is printed on failure).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

#[test]
fn truncated_and_flipped_databases_are_errors_never_panics() {
    for (version, file) in FIXTURES {
        let db = &file[..file.len() - HASH];
        let mut errors = 0;
        for cut in (0..db.len()).step_by(97) {
            errors += usize::from(read(&db[..cut]).is_err());
        }
        assert!(errors > db.len() / 97 / 2, "{version}: most cuts lose pages the meta names");
        let seed = 0x5eed_0000 + file.len() as u64;
        let mut rng = Lcg(seed);
        let mut flipped = 0;
        for round in 0..3000 {
            let mut bad = db.to_vec();
            for _ in 0..1 + round % 4 {
                let at = rng.next() as usize % bad.len();
                bad[at] ^= 1 << (rng.next() % 8);
            }
            // Ok (a flip in unused space or in a value) or a typed error; a panic fails the test.
            flipped += usize::from(bbolt::Db::open(&bad).and_then(|d| EtcdState::read(&d)).is_err());
        }
        assert!(flipped > 0, "{version} (seed {seed:#x}): some flips must hit structure");
    }
}

#[test]
fn restoring_an_empty_etcd_starts_at_revision_one() {
    let state = EtcdState::default();
    let file = write(&state).unwrap();
    let back = read(&file).unwrap();
    assert_eq!((back.revision, back.keys.len()), (1, 0));
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(restore(dir.path(), &back, Arc::new(StdFs)).unwrap(), 1);
}

/// An etcd-shaped file with `meta` and `key` (empty unless given) and the buckets given.
fn etcd_file(buckets: Vec<(&'static str, bbolt::Rows)>) -> Vec<u8> {
    let mut all: Vec<(&[u8], bbolt::Rows)> = vec![(b"key", Vec::new()), (b"meta", Vec::new())];
    for (name, rows) in buckets {
        all.retain(|(n, _)| *n != name.as_bytes());
        all.push((name.as_bytes(), rows));
    }
    all.sort_by(|a, b| a.0.cmp(b.0));
    bbolt_writer::write(&all).unwrap()
}

fn revision_key(main: i64, sub: i64) -> Vec<u8> {
    let mut k = main.to_be_bytes().to_vec();
    k.push(b'_');
    k.extend_from_slice(&sub.to_be_bytes());
    k
}

#[test]
fn malformed_records_are_named_by_bucket_and_key() {
    use prost::Message;
    let kv = |key: &str, rev: i64| etcd_client::proto::PbKeyValue {
        key: key.into(),
        create_revision: rev,
        mod_revision: rev,
        version: 1,
        ..Default::default()
    };
    let cases: Vec<(&str, Vec<(&'static str, bbolt::Rows)>)> = vec![
        ("a short revision key", vec![("key", vec![(b"1234".to_vec(), kv("a", 1).encode_to_vec())])]),
        ("a value that is not a KeyValue", vec![("key", vec![(revision_key(1, 0), vec![0xff, 0xff, 0xff])])]),
        ("a mod revision other than the key's", vec![("key", vec![(revision_key(2, 0), kv("a", 1).encode_to_vec())])]),
        (
            "a lease record naming another lease",
            vec![(
                "lease",
                vec![(
                    7u64.to_be_bytes().to_vec(),
                    schema::LeasePb { id: 8, ttl: 5, remaining_ttl: 0 }.encode_to_vec(),
                )],
            )],
        ),
        ("a consistent index that is not 8 bytes", vec![("meta", vec![(b"consistent_index".to_vec(), vec![1, 2, 3])])]),
    ];
    for (what, buckets) in cases {
        let err = read(&etcd_file(buckets)).err();
        assert!(matches!(err, Some(Error::Record { .. })), "{what}: {err:?}");
    }
}

#[test]
fn a_key_whose_lease_is_not_in_the_file_is_restored_without_one() {
    let state = EtcdState {
        revision: 3,
        keys: vec![
            etcd_client::proto::PbKeyValue {
                key: b"orphan".to_vec(),
                create_revision: 2,
                mod_revision: 2,
                version: 1,
                lease: 99,
                ..Default::default()
            },
            etcd_client::proto::PbKeyValue {
                key: b"kept".to_vec(),
                create_revision: 3,
                mod_revision: 3,
                version: 1,
                lease: 5,
                ..Default::default()
            },
        ],
        leases: vec![(5, 60)],
        ..EtcdState::default()
    };
    let dir = tempfile::tempdir().unwrap();
    restore(dir.path(), &state, Arc::new(StdFs)).unwrap();
    let db = open(dir.path());
    let txn = db.begin_read().unwrap();
    assert_eq!(Record::decode(&txn.get(KV, b"orphan").unwrap().unwrap()).unwrap().lease, 0);
    assert_eq!(Record::decode(&txn.get(KV, b"kept").unwrap().unwrap()).unwrap().lease, 5);
    assert_eq!(lease::stored_keys(&txn, 5).unwrap(), vec![b"kept".to_vec()]);
    assert!(lease::stored_keys(&txn, 99).unwrap().is_empty());
}

#[test]
fn auth_state_keel_cannot_hold_is_refused_before_the_store_is_written() {
    let role = |perm_type| schema::RolePb {
        name: b"r".to_vec(),
        key_permission: vec![schema::PermissionPb { perm_type, key: b"k".to_vec(), range_end: Vec::new() }],
    };
    let unknown_perm = EtcdState { roles: vec![role(7)], ..EtcdState::default() };
    // Auth on without a root user: etcd never writes this, keel's rules refuse it.
    let no_root = EtcdState { auth_enabled: true, ..EtcdState::default() };
    for state in [unknown_perm, no_root] {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(restore(dir.path(), &state, Arc::new(StdFs)), Err(Error::Auth(_))));
        assert!(!dir.path().join("store").exists(), "nothing written");
    }
}

#[test]
fn a_damaged_first_meta_page_falls_back_to_the_second_and_two_are_refused() {
    let db = &ETCD_3_6[..ETCD_3_6.len() - HASH];
    let mut one = db.to_vec();
    one[16 + 20] ^= 0x01; // meta 0's root page: its checksum no longer holds
    check_fixture("3.6.16, meta 0 damaged", &read(&one).unwrap());
    let mut both = one.clone();
    both[4096 + 16 + 20] ^= 0x01;
    assert!(matches!(read(&both), Err(Error::NotBbolt(_))));
}

#[test]
fn a_tombstone_ends_a_key_until_it_is_put_again() {
    use prost::Message;
    let kv = |key: &str, value: &str, create: i64, rev: i64, version: i64| etcd_client::proto::PbKeyValue {
        key: key.into(),
        value: value.into(),
        create_revision: create,
        mod_revision: rev,
        version,
        lease: 0,
    };
    let tombstone = |main: i64| {
        let mut k = revision_key(main, 0);
        k.push(b't');
        (
            k,
            etcd_client::proto::PbKeyValue { key: b"a".to_vec(), mod_revision: main, ..Default::default() }
                .encode_to_vec(),
        )
    };
    let rows = vec![
        (revision_key(2, 0), kv("a", "1", 2, 2, 1).encode_to_vec()),
        (revision_key(2, 1), kv("gone", "x", 2, 2, 1).encode_to_vec()),
        tombstone(3),
        (revision_key(4, 0), kv("a", "2", 4, 4, 1).encode_to_vec()),
        {
            let (mut k, v) = tombstone(5);
            k[..8].copy_from_slice(&5i64.to_be_bytes());
            let mut gone = etcd_client::proto::PbKeyValue::decode(v.as_slice()).unwrap();
            gone.key = b"gone".to_vec();
            (k, gone.encode_to_vec())
        },
    ];
    let state = read(&etcd_file(vec![("key", rows)])).unwrap();
    assert_eq!(state.revision, 5, "a tombstone's revision counts");
    assert_eq!(state.keys, vec![kv("a", "2", 4, 4, 1)]);
}
