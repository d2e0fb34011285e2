package main

// keelcheck compat: etcd v3 KV semantics through clientv3, checked step by step. It assumes
// nobody else writes to the cluster while it runs (it checks exact revision steps).

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

type compat struct {
	cli      *clientv3.Client
	timeout  time.Duration
	section  string
	checks   int
	failures []string
}

func (c *compat) ctx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), c.timeout)
}

// expect records one check; the message says what etcd does.
func (c *compat) expect(ok bool, format string, args ...interface{}) bool {
	c.checks++
	if !ok {
		msg := fmt.Sprintf("[%s] %s", c.section, fmt.Sprintf(format, args...))
		c.failures = append(c.failures, msg)
		fmt.Fprintln(os.Stderr, "MISMATCH", msg)
	}
	return ok
}

func (c *compat) noErr(err error, what string) bool {
	return c.expect(err == nil, "%s: unexpected error: %v", what, err)
}

func runCompat(args []string) int {
	fs := flag.NewFlagSet("compat", flag.ContinueOnError)
	eps := fs.String("endpoints", "127.0.0.1:2379", "comma-separated client endpoints (host:port or http://host:port)")
	members := fs.Int("expect-members", 0, "expected MemberList size (0: the number of endpoints)")
	timeout := fs.Duration("timeout", 5*time.Second, "timeout of each request")
	skipLease := fs.Bool("skip-lease", false, "skip the lease section")
	skipWatch := fs.Bool("skip-watch", false, "skip the watch section")
	skipCompact := fs.Bool("skip-compact", false, "skip the compaction section")
	serverBin := fs.String("server-bin", "", "instead of --endpoints: start a cluster of this server binary on 127.0.0.1 (as keelcheck fault does), check it, stop it")
	nodes := fs.Int("nodes", 3, "with --server-bin: cluster size")
	workdir := fs.String("workdir", "", "with --server-bin: directory for data dirs and server logs")
	basePort := fs.Int("base-port", 23890, "with --server-bin: node i listens on client port P+2i and peer port P+2i+1")
	var serverArgs, preArgs stringList
	fs.Var(&serverArgs, "server-arg", "with --server-bin: extra server argument after the member flags (repeatable)")
	fs.Var(&preArgs, "server-pre-arg", "with --server-bin: argument before the member flags, e.g. serve (repeatable)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *serverBin != "" {
		if *workdir == "" {
			fmt.Fprintln(os.Stderr, "keelcheck compat: --server-bin needs --workdir")
			return 2
		}
		if err := os.MkdirAll(*workdir, 0o755); err != nil {
			fmt.Fprintln(os.Stderr, "keelcheck compat:", err)
			return 2
		}
		for i := 1; i <= *nodes; i++ {
			_ = os.RemoveAll(filepath.Join(*workdir, fmt.Sprintf("n%d.data", i)))
			_ = os.Remove(filepath.Join(*workdir, fmt.Sprintf("n%d.log", i)))
		}
		cl := newCluster(*serverBin, *workdir, *nodes, *basePort, preArgs, serverArgs, "", nil)
		guardCluster = cl
		defer cl.killAll()
		sigs := make(chan os.Signal, 1)
		signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
		go func() {
			<-sigs
			cl.killAll()
			os.Exit(130)
		}()
		for i := range cl.nodes {
			if err := cl.start(i); err != nil {
				fmt.Fprintln(os.Stderr, "keelcheck compat:", err)
				return 2
			}
		}
		if _, err := cl.waitHealthy(context.Background(), 60*time.Second); err != nil {
			fmt.Fprintln(os.Stderr, "keelcheck compat: cluster never became healthy:", err)
			return 3
		}
		*eps = strings.Join(cl.endpoints(), ",")
	}
	endpoints := strings.Split(*eps, ",")
	for _, ep := range endpoints {
		if !strings.Contains(ep, "127.0.0.1") && !strings.Contains(ep, "localhost") && !strings.Contains(ep, "[::1]") {
			fmt.Fprintf(os.Stderr, "keelcheck compat: %s is not a loopback endpoint\n", ep)
			return 2
		}
	}
	if *members == 0 {
		*members = len(endpoints)
	}
	cli, err := newClient(endpoints, *timeout)
	if err != nil {
		fmt.Fprintln(os.Stderr, "keelcheck compat:", err)
		return 2
	}
	defer cli.Close()
	c := &compat{cli: cli, timeout: *timeout}
	prefix := fmt.Sprintf("keelcheck-compat/%d/", time.Now().UnixNano())

	c.cluster(endpoints, *members)
	c.kv(prefix)
	c.txn(prefix)
	c.deletes(prefix)
	if !*skipLease {
		c.lease(prefix)
	}
	if !*skipWatch {
		c.watch(prefix)
	}
	if !*skipCompact {
		c.compact(prefix)
	}
	// Leave nothing behind (best effort).
	ctx, cancel := c.ctx()
	_, _ = cli.Delete(ctx, prefix, clientv3.WithPrefix())
	cancel()

	if len(c.failures) > 0 {
		fmt.Printf("keelcheck compat: %d checks, %d mismatches\n", c.checks, len(c.failures))
		return 1
	}
	fmt.Printf("keelcheck compat: %d checks, 0 mismatches\n", c.checks)
	return 0
}

func (c *compat) cluster(endpoints []string, members int) {
	c.section = "status"
	var clusterID, leader uint64
	for _, ep := range endpoints {
		ctx, cancel := c.ctx()
		st, err := c.cli.Status(ctx, ep)
		cancel()
		if !c.noErr(err, "Maintenance.Status on "+ep) {
			continue
		}
		h := st.Header
		if !c.expect(h != nil, "%s: Status has no response header", ep) {
			continue
		}
		c.expect(h.ClusterId != 0 && h.MemberId != 0, "%s: header.cluster_id and header.member_id must be non-zero, got %d and %d", ep, h.ClusterId, h.MemberId)
		c.expect(h.Revision > 0, "%s: header.revision must be >= 1, got %d", ep, h.Revision)
		c.expect(h.RaftTerm > 0, "%s: header.raft_term must be >= 1, got %d", ep, h.RaftTerm)
		c.expect(st.Leader != 0, "%s: status.leader must be the leader's member id, got 0", ep)
		c.expect(st.RaftTerm > 0 && st.RaftIndex > 0, "%s: status.raft_term and raft_index must be >= 1, got %d, %d", ep, st.RaftTerm, st.RaftIndex)
		c.expect(st.Version != "", "%s: status.version must name the server version (etcdctl prints it)", ep)
		c.expect(st.DbSize > 0, "%s: status.db_size must be > 0 (etcdctl prints it), got %d", ep, st.DbSize)
		if clusterID == 0 {
			clusterID, leader = h.ClusterId, st.Leader
		} else {
			c.expect(h.ClusterId == clusterID, "%s: cluster_id %x differs from %x of the first endpoint", ep, h.ClusterId, clusterID)
			c.expect(st.Leader == leader, "%s: leader %x differs from %x of the first endpoint", ep, st.Leader, leader)
		}
	}

	c.section = "member-list"
	ctx, cancel := c.ctx()
	ml, err := c.cli.MemberList(ctx)
	cancel()
	if c.noErr(err, "Cluster.MemberList") {
		c.expect(len(ml.Members) == members, "MemberList has %d members, want %d", len(ml.Members), members)
		self := false
		for _, m := range ml.Members {
			c.expect(m.ID != 0 && m.Name != "", "member %x: id and name must be set (name %q)", m.ID, m.Name)
			c.expect(len(m.PeerURLs) > 0 && len(m.ClientURLs) > 0, "member %s: peer_urls and client_urls must be set, got %v %v", m.Name, m.PeerURLs, m.ClientURLs)
			c.expect(!m.IsLearner, "member %s is a learner", m.Name)
			if ml.Header != nil && m.ID == ml.Header.MemberId {
				self = true
			}
			if leader != 0 && m.ID == leader {
				leader = 0 // found
			}
		}
		c.expect(self, "header.member_id of MemberList is not in the member list")
		c.expect(leader == 0, "status.leader is not in the member list")
	}

	c.section = "alarm"
	ctx, cancel = c.ctx()
	al, err := c.cli.AlarmList(ctx)
	cancel()
	if c.noErr(err, "Maintenance.Alarm (list; etcdctl endpoint health calls it)") {
		c.expect(len(al.Alarms) == 0, "a healthy cluster has no alarms, got %v", al.Alarms)
	}
}

func (c *compat) get(key string, opts ...clientv3.OpOption) *clientv3.GetResponse {
	ctx, cancel := c.ctx()
	defer cancel()
	resp, err := c.cli.Get(ctx, key, opts...)
	if !c.noErr(err, "Get "+key) {
		return nil
	}
	return resp
}

func (c *compat) put(key, val string, opts ...clientv3.OpOption) *clientv3.PutResponse {
	ctx, cancel := c.ctx()
	defer cancel()
	resp, err := c.cli.Put(ctx, key, val, opts...)
	if !c.noErr(err, "Put "+key) {
		return nil
	}
	return resp
}

func (c *compat) one(resp *clientv3.GetResponse, key string) *mvccpb.KeyValue {
	if resp == nil {
		return nil
	}
	if !c.expect(len(resp.Kvs) == 1 && resp.Count == 1, "Get %s: want 1 kv and count 1, got %d kvs count %d", key, len(resp.Kvs), resp.Count) {
		return nil
	}
	return resp.Kvs[0]
}

func (c *compat) kv(prefix string) {
	c.section = "kv"
	k := prefix + "a"
	c.expect(c.get(k) != nil && len(c.get(k).Kvs) == 0, "Get of a missing key returns no kvs")

	p1 := c.put(k, "one")
	if p1 == nil {
		return
	}
	r1 := p1.Header.Revision
	c.expect(p1.PrevKv == nil, "Put without prev_kv returns no prev_kv")
	if kv := c.one(c.get(k), k); kv != nil {
		c.expect(string(kv.Key) == k && string(kv.Value) == "one", "Get returns the put value: got %q=%q", kv.Key, kv.Value)
		c.expect(kv.CreateRevision == r1 && kv.ModRevision == r1, "a new key has create_revision == mod_revision == the put's header revision %d, got %d/%d", r1, kv.CreateRevision, kv.ModRevision)
		c.expect(kv.Version == 1, "a new key has version 1, got %d", kv.Version)
		c.expect(kv.Lease == 0, "lease 0 without a lease, got %d", kv.Lease)
	}
	p2 := c.put(k, "two", clientv3.WithPrevKV())
	if p2 == nil {
		return
	}
	r2 := p2.Header.Revision
	c.expect(r2 == r1+1, "every write transaction adds exactly one revision: %d then %d", r1, r2)
	c.expect(p2.PrevKv != nil && string(p2.PrevKv.Value) == "one" && p2.PrevKv.ModRevision == r1, "Put with prev_kv returns the previous kv (value one, mod_revision %d), got %v", r1, p2.PrevKv)
	if kv := c.one(c.get(k), k); kv != nil {
		c.expect(kv.CreateRevision == r1, "create_revision stays %d on overwrite, got %d", r1, kv.CreateRevision)
		c.expect(kv.ModRevision == r2, "mod_revision becomes %d, got %d", r2, kv.ModRevision)
		c.expect(kv.Version == 2, "version counts writes since creation: want 2, got %d", kv.Version)
	}
	// Reads do not move the revision.
	if g := c.get(k); g != nil {
		c.expect(g.Header.Revision == r2, "a read returns the current revision %d in its header, got %d", r2, g.Header.Revision)
	}
	// Historical read.
	if g := c.get(k, clientv3.WithRev(r1)); g != nil {
		if kv := c.one(g, k); kv != nil {
			c.expect(string(kv.Value) == "one" && kv.Version == 1, "Get at revision %d returns the old value one/version 1, got %q/%d", r1, kv.Value, kv.Version)
		}
	}
	// Empty value is a value.
	if p := c.put(prefix+"empty", ""); p != nil {
		if kv := c.one(c.get(prefix+"empty"), prefix+"empty"); kv != nil {
			c.expect(len(kv.Value) == 0, "an empty value reads back empty, got %q", kv.Value)
		}
	}

	c.section = "range"
	rp := prefix + "r/"
	var last int64
	for _, s := range []string{"c", "a", "b", "d"} {
		if p := c.put(rp+s, "val-"+s); p != nil {
			last = p.Header.Revision
		}
	}
	keysOf := func(g *clientv3.GetResponse) string {
		var ks []string
		for _, kv := range g.Kvs {
			ks = append(ks, strings.TrimPrefix(string(kv.Key), rp))
		}
		return strings.Join(ks, ",")
	}
	if g := c.get(rp, clientv3.WithPrefix()); g != nil {
		c.expect(keysOf(g) == "a,b,c,d" && g.Count == 4 && !g.More, "prefix range returns keys in ascending order with count 4: got %s count %d more %v", keysOf(g), g.Count, g.More)
		c.expect(g.Header.Revision == last, "range header revision is the last write %d, got %d", last, g.Header.Revision)
	}
	if g := c.get(rp, clientv3.WithPrefix(), clientv3.WithLimit(2)); g != nil {
		c.expect(keysOf(g) == "a,b" && g.Count == 4 && g.More, "limit 2: first two keys, count 4 (all matches), more=true: got %s count %d more %v", keysOf(g), g.Count, g.More)
	}
	if g := c.get(rp+"b", clientv3.WithRange(rp+"d")); g != nil {
		c.expect(keysOf(g) == "b,c", "range [b, d) returns b,c: got %s", keysOf(g))
	}
	if g := c.get(rp+"b", clientv3.WithFromKey()); g != nil {
		c.expect(strings.HasPrefix(keysOf(g), "b,c,d"), "from-key range starts b,c,d: got %s", keysOf(g))
	}
	if g := c.get(rp, clientv3.WithPrefix(), clientv3.WithCountOnly()); g != nil {
		c.expect(len(g.Kvs) == 0 && g.Count == 4, "count_only: no kvs and count 4, got %d kvs count %d", len(g.Kvs), g.Count)
	}
	if g := c.get(rp, clientv3.WithPrefix(), clientv3.WithKeysOnly()); g != nil {
		empty := true
		for _, kv := range g.Kvs {
			if len(kv.Value) != 0 {
				empty = false
			}
		}
		c.expect(len(g.Kvs) == 4 && empty, "keys_only: 4 kvs with empty values")
	}
	if g := c.get(rp, clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByKey, clientv3.SortDescend)); g != nil {
		c.expect(keysOf(g) == "d,c,b,a", "sort by key descending: got %s", keysOf(g))
	}
	if g := c.get(rp, clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByModRevision, clientv3.SortAscend)); g != nil {
		c.expect(keysOf(g) == "c,a,b,d", "sort by mod_revision ascending follows write order c,a,b,d: got %s", keysOf(g))
	}
	if g := c.get(rp, clientv3.WithPrefix(), clientv3.WithSerializable()); g != nil {
		c.expect(len(g.Kvs) == 4, "serializable range answers (from the local member): got %d kvs", len(g.Kvs))
	}
}

func (c *compat) txn(prefix string) {
	c.section = "txn"
	k := prefix + "t"
	p1 := c.put(k, "x")
	if p1 == nil {
		return
	}
	p2 := c.put(k, "y")
	if p2 == nil {
		return
	}
	r1, r2 := p1.Header.Revision, p2.Header.Revision
	other := prefix + "t2"
	ctx, cancel := c.ctx()
	resp, err := c.cli.Txn(ctx).If(
		clientv3.Compare(clientv3.Value(k), "=", "y"),
		clientv3.Compare(clientv3.Version(k), "=", 2),
		clientv3.Compare(clientv3.CreateRevision(k), "=", r1),
		clientv3.Compare(clientv3.ModRevision(k), "=", r2),
		clientv3.Compare(clientv3.ModRevision(k), "<", r2+1),
		clientv3.Compare(clientv3.Version(other), "=", 0), // a missing key has version 0
	).Then(
		clientv3.OpPut(k, "z"),
		clientv3.OpPut(other, "w"),
		clientv3.OpGet(k),
	).Else(clientv3.OpGet(k)).Commit()
	cancel()
	if c.noErr(err, "Txn with value/version/create/mod compares") {
		c.expect(resp.Succeeded, "all compares hold (value y, version 2, create_revision %d, mod_revision %d, missing key version 0): want succeeded", r1, r2)
		c.expect(resp.Header.Revision == r2+1, "a txn with two puts adds one revision: want %d, got %d", r2+1, resp.Header.Revision)
		if c.expect(len(resp.Responses) == 3, "then branch with 3 ops returns 3 responses, got %d", len(resp.Responses)) {
			c.expect(resp.Responses[0].GetResponsePut() != nil && resp.Responses[1].GetResponsePut() != nil, "responses 0 and 1 are put responses")
			if rr := resp.Responses[2].GetResponseRange(); c.expect(rr != nil && len(rr.Kvs) == 1, "response 2 is a range with one kv") {
				c.expect(string(rr.Kvs[0].Value) == "z" && rr.Kvs[0].ModRevision == r2+1, "a get inside a txn sees the txn's own put (z at %d), got %q at %d", r2+1, rr.Kvs[0].Value, rr.Kvs[0].ModRevision)
			}
		}
		if kv := c.one(c.get(other), other); kv != nil {
			c.expect(kv.ModRevision == r2+1 && kv.CreateRevision == r2+1, "both puts of one txn share revision %d, got %d", r2+1, kv.ModRevision)
		}
	}
	// A failing compare runs the else branch and writes nothing.
	ctx, cancel = c.ctx()
	resp, err = c.cli.Txn(ctx).If(clientv3.Compare(clientv3.Value(k), "=", "nope")).
		Then(clientv3.OpPut(k, "bad")).Else(clientv3.OpGet(k)).Commit()
	cancel()
	if c.noErr(err, "Txn with a failing compare") {
		c.expect(!resp.Succeeded, "value compare against a different value fails")
		c.expect(resp.Header.Revision == r2+1, "a txn that writes nothing keeps the revision %d, got %d", r2+1, resp.Header.Revision)
		if c.expect(len(resp.Responses) == 1 && resp.Responses[0].GetResponseRange() != nil, "else branch returns its one range response") {
			kvs := resp.Responses[0].GetResponseRange().Kvs
			c.expect(len(kvs) == 1 && string(kvs[0].Value) == "z", "else branch reads z")
		}
	}
	// Value compare on a missing key is false (etcd: always fails), version compare is 0.
	ctx, cancel = c.ctx()
	resp, err = c.cli.Txn(ctx).If(clientv3.Compare(clientv3.Value(prefix+"missing"), "=", "")).
		Then(clientv3.OpPut(prefix+"missing", "bad")).Commit()
	cancel()
	if c.noErr(err, "Txn comparing the value of a missing key") {
		c.expect(!resp.Succeeded, "a value compare on a missing key fails in etcd, even against the empty value")
	}
	// Greater/less on revisions.
	ctx, cancel = c.ctx()
	resp, err = c.cli.Txn(ctx).If(
		clientv3.Compare(clientv3.CreateRevision(k), ">", r1-1),
		clientv3.Compare(clientv3.Version(k), ">", 2),
		clientv3.Compare(clientv3.Value(k), "!=", "q"),
	).Commit()
	cancel()
	if c.noErr(err, "Txn with >, != compares and no ops") {
		c.expect(resp.Succeeded, "create_revision > %d, version > 2 (it is 3), value != q all hold", r1-1)
	}
}

func (c *compat) deletes(prefix string) {
	c.section = "delete"
	dp := prefix + "d/"
	var last int64
	for _, s := range []string{"a", "b", "c"} {
		if p := c.put(dp+s, "v"+s); p != nil {
			last = p.Header.Revision
		}
	}
	ctx, cancel := c.ctx()
	d, err := c.cli.Delete(ctx, dp+"a", clientv3.WithPrevKV())
	cancel()
	if c.noErr(err, "Delete one key with prev_kv") {
		c.expect(d.Deleted == 1, "deleted 1, got %d", d.Deleted)
		c.expect(len(d.PrevKvs) == 1 && string(d.PrevKvs[0].Value) == "va", "prev_kvs has the deleted kv")
		c.expect(d.Header.Revision == last+1, "a delete adds one revision: want %d, got %d", last+1, d.Header.Revision)
		last = d.Header.Revision
	}
	ctx, cancel = c.ctx()
	d, err = c.cli.Delete(ctx, dp+"nothing")
	cancel()
	if c.noErr(err, "Delete of a missing key") {
		c.expect(d.Deleted == 0, "deleting a missing key deletes 0")
		c.expect(d.Header.Revision == last, "deleting nothing keeps the revision %d, got %d", last, d.Header.Revision)
	}
	ctx, cancel = c.ctx()
	d, err = c.cli.Delete(ctx, dp, clientv3.WithPrefix(), clientv3.WithPrevKV())
	cancel()
	if c.noErr(err, "DeleteRange of a prefix with prev_kv") {
		c.expect(d.Deleted == 2, "prefix delete removes the remaining 2 keys, got %d", d.Deleted)
		var ks []string
		for _, kv := range d.PrevKvs {
			ks = append(ks, strings.TrimPrefix(string(kv.Key), dp))
		}
		c.expect(strings.Join(ks, ",") == "b,c", "prev_kvs are b,c in key order, got %v", ks)
		c.expect(d.Header.Revision == last+1, "one DeleteRange of 2 keys adds one revision: want %d, got %d", last+1, d.Header.Revision)
		last = d.Header.Revision
	}
	if g := c.get(dp, clientv3.WithPrefix()); g != nil {
		c.expect(len(g.Kvs) == 0 && g.Count == 0, "nothing is left under the prefix")
	}
	// Re-creating a deleted key starts a new generation.
	if p := c.put(dp+"b", "again"); p != nil {
		if kv := c.one(c.get(dp+"b"), dp+"b"); kv != nil {
			c.expect(kv.Version == 1 && kv.CreateRevision == p.Header.Revision, "a re-created key has version 1 and a new create_revision %d, got %d/%d", p.Header.Revision, kv.Version, kv.CreateRevision)
		}
	}
}

func (c *compat) lease(prefix string) {
	c.section = "lease"
	ctx, cancel := c.ctx()
	defer cancel()
	g, err := c.cli.Grant(ctx, 30)
	if !c.noErr(err, "Lease.Grant") {
		return
	}
	c.expect(g.ID != 0 && g.TTL >= 30, "grant returns an id and TTL >= 30, got %x %d", g.ID, g.TTL)
	k := prefix + "leased"
	if _, err := c.cli.Put(ctx, k, "v", clientv3.WithLease(g.ID)); !c.noErr(err, "Put with a lease") {
		return
	}
	if kv := c.one(c.get(k), k); kv != nil {
		c.expect(clientv3.LeaseID(kv.Lease) == g.ID, "the kv carries its lease id")
	}
	ttl, err := c.cli.TimeToLive(ctx, g.ID, clientv3.WithAttachedKeys())
	if c.noErr(err, "Lease.TimeToLive") {
		c.expect(ttl.TTL > 0 && ttl.TTL <= 30 && len(ttl.Keys) == 1 && string(ttl.Keys[0]) == k, "TimeToLive reports the remaining TTL and the attached key, got %d %q", ttl.TTL, ttl.Keys)
	}
	if _, err := c.cli.KeepAliveOnce(ctx, g.ID); err != nil {
		c.noErr(err, "Lease.KeepAlive (once)")
	}
	if _, err := c.cli.Revoke(ctx, g.ID); c.noErr(err, "Lease.Revoke") {
		if resp := c.get(k); resp != nil {
			c.expect(len(resp.Kvs) == 0, "revoking a lease deletes its keys")
		}
	}
}

func (c *compat) watch(prefix string) {
	c.section = "watch"
	wp := prefix + "w/"
	p := c.put(wp+"before", "0")
	if p == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*c.timeout)
	defer cancel()
	wch := c.cli.Watch(clientv3.WithRequireLeader(ctx), wp, clientv3.WithPrefix(), clientv3.WithRev(p.Header.Revision), clientv3.WithPrevKV())
	p2 := c.put(wp+"before", "1")
	ctx2, cancel2 := c.ctx()
	_, _ = c.cli.Delete(ctx2, wp+"before")
	cancel2()
	if p2 == nil {
		return
	}
	var evs []*clientv3.Event
	for len(evs) < 3 {
		select {
		case wr, ok := <-wch:
			if !ok || wr.Err() != nil {
				c.expect(false, "watch ended early: %v", wr.Err())
				return
			}
			evs = append(evs, wr.Events...)
		case <-ctx.Done():
			c.expect(false, "watch from revision %d delivered %d of 3 events in %v", p.Header.Revision, len(evs), 3*c.timeout)
			return
		}
	}
	c.expect(evs[0].Type == mvccpb.PUT && string(evs[0].Kv.Value) == "0" && evs[0].Kv.ModRevision == p.Header.Revision, "watch from a past revision replays the put at %d", p.Header.Revision)
	c.expect(evs[1].Type == mvccpb.PUT && string(evs[1].Kv.Value) == "1" && evs[1].PrevKv != nil && string(evs[1].PrevKv.Value) == "0", "second event: put 1 with prev_kv 0")
	c.expect(evs[2].Type == mvccpb.DELETE && evs[2].Kv.ModRevision == p2.Header.Revision+1, "third event: delete at %d", p2.Header.Revision+1)
}

func (c *compat) compact(prefix string) {
	c.section = "compact"
	k := prefix + "cmp"
	p1 := c.put(k, "old")
	p2 := c.put(k, "new")
	if p1 == nil || p2 == nil {
		return
	}
	ctx, cancel := c.ctx()
	_, err := c.cli.Compact(ctx, p2.Header.Revision, clientv3.WithCompactPhysical())
	cancel()
	if !c.noErr(err, "KV.Compact") {
		return
	}
	ctx, cancel = c.ctx()
	_, err = c.cli.Get(ctx, k, clientv3.WithRev(p1.Header.Revision))
	cancel()
	c.expect(errors.Is(err, rpctypes.ErrCompacted), "a read below the compacted revision fails with %q, got %v", rpctypes.ErrCompacted, err)
	if g := c.get(k, clientv3.WithRev(p2.Header.Revision)); g != nil {
		c.expect(len(g.Kvs) == 1 && string(g.Kvs[0].Value) == "new", "a read at the compacted revision itself still works")
	}
}
