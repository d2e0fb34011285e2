// lockcheck drives etcd's server-side concurrency API (v3lockpb.Lock, v3electionpb.Election)
// over plain gRPC and prints a transcript with everything run-specific (lease ids,
// revisions, member ids) replaced by facts about them, so that the transcripts of keel and of
// etcd can be compared with diff:
//
//	lockcheck --endpoint 127.0.0.1:2379 > etcd.txt
//	lockcheck --endpoint 127.0.0.1:12379 > keel.txt
//	diff etcd.txt keel.txt
//
// Build: cd tools/go/lockcheck && GOFLAGS=-mod=readonly go build -o ../../../.tools/bin/lockcheck .
// (the same pins as tools/go/etcd: go.etcd.io/etcd/server/v3 v3.6.16).
//
// A client deadline is the one line expected to differ: grpc-go's server answers an expired
// grpc-timeout with DeadlineExceeded, tonic's with Canceled "Timeout expired" (whichever of
// client and server notices first decides what the client sees).
//
// It expects a fresh member (no keys under lc-*, auth disabled) and leaves auth disabled.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"sync"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/server/v3/etcdserver/api/v3election/v3electionpb"
	"go.etcd.io/etcd/server/v3/etcdserver/api/v3lock/v3lockpb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

type checker struct {
	kv    pb.KVClient
	lease pb.LeaseClient
	auth  pb.AuthClient
	lock  v3lockpb.LockClient
	elect v3electionpb.ElectionClient
}

func main() {
	endpoint := flag.String("endpoint", "127.0.0.1:2379", "a member's client address")
	flag.Parse()
	cc, err := grpc.NewClient(*endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer cc.Close()
	c := &checker{pb.NewKVClient(cc), pb.NewLeaseClient(cc), pb.NewAuthClient(cc), v3lockpb.NewLockClient(cc), v3electionpb.NewElectionClient(cc)}
	c.locks()
	c.elections()
	c.withAuth()
}

var (
	cancelsMu sync.Mutex
	cancels   []context.CancelFunc
)

// ctx is a call's context: 10 s, cancelled when the program ends.
func ctx() context.Context {
	c, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	cancelsMu.Lock()
	cancels = append(cancels, cancel)
	cancelsMu.Unlock()
	return c
}

func say(format string, args ...any) { fmt.Printf(format+"\n", args...) }

// outcome prints a call's gRPC code and message (or "ok").
func outcome(what string, err error) {
	if err == nil {
		say("%s: ok", what)
		return
	}
	s, _ := status.FromError(err)
	say("%s: %s %q", what, s.Code(), s.Message())
}

func (c *checker) grant(ttl int64) int64 {
	r, err := c.lease.LeaseGrant(ctx(), &pb.LeaseGrantRequest{TTL: ttl})
	if err != nil {
		panic(err)
	}
	return r.ID
}

func (c *checker) exists(key []byte) bool {
	r, err := c.kv.Range(ctx(), &pb.RangeRequest{Key: key})
	if err != nil {
		panic(err)
	}
	return r.Count == 1
}

func keyOf(name string, lease int64) string { return fmt.Sprintf("%s/%x", name, lease) }

type lockResult struct {
	resp *v3lockpb.LockResponse
	err  error
}

func (c *checker) lockAsync(name string, lease int64) chan lockResult {
	ch := make(chan lockResult, 1)
	go func() {
		r, err := c.lock.Lock(ctx(), &v3lockpb.LockRequest{Name: []byte(name), Lease: lease})
		ch <- lockResult{r, err}
	}()
	return ch
}

func waiting[T any](ch chan T) bool {
	select {
	case <-ch:
		return false
	case <-time.After(500 * time.Millisecond):
		return true
	}
}

func (c *checker) locks() {
	l1, l2 := c.grant(30), c.grant(30)
	r1, err := c.lock.Lock(ctx(), &v3lockpb.LockRequest{Name: []byte("lc-a"), Lease: l1})
	outcome("lock uncontended", err)
	say("lock key is name/hex(lease): %v", string(r1.Key) == keyOf("lc-a", l1))
	second := c.lockAsync("lc-a", l2)
	say("second locker waits: %v", waiting(second))
	_, err = c.lock.Unlock(ctx(), &v3lockpb.UnlockRequest{Key: r1.Key})
	outcome("unlock", err)
	r2 := <-second
	outcome("second lock", r2.err)
	say("second header revision above the first: %v", r2.resp.Header.Revision > r1.Header.Revision)
	again, err := c.lock.Lock(ctx(), &v3lockpb.LockRequest{Name: []byte("lc-a"), Lease: l2})
	outcome("lock again with the holder's lease", err)
	say("same key: %v", err == nil && string(again.Key) == string(r2.resp.Key))

	l3 := c.grant(30)
	third := c.lockAsync("lc-a", l3)
	say("third waits: %v", waiting(third))
	_, err = c.lease.LeaseRevoke(ctx(), &pb.LeaseRevokeRequest{ID: l3})
	outcome("revoke the waiter's lease", err)
	say("third still waits: %v", waiting(third))
	c.lock.Unlock(ctx(), &v3lockpb.UnlockRequest{Key: r2.resp.Key})
	outcome("third lock", (<-third).err)

	_, err = c.lock.Lock(ctx(), &v3lockpb.LockRequest{Name: []byte("lc-a"), Lease: 0x7777})
	outcome("lock with an unknown lease", err)
	own, err := c.lock.Lock(ctx(), &v3lockpb.LockRequest{Name: []byte("lc-b")})
	outcome("lock with no lease", err)
	kv, _ := c.kv.Range(ctx(), &pb.RangeRequest{Key: own.Key})
	ttl, _ := c.lease.LeaseTimeToLive(ctx(), &pb.LeaseTimeToLiveRequest{ID: kv.Kvs[0].Lease})
	say("session lease ttl: %d", ttl.GrantedTTL)
	_, err = c.lock.Unlock(ctx(), &v3lockpb.UnlockRequest{})
	outcome("unlock with no key", err)
	_, err = c.lock.Unlock(ctx(), &v3lockpb.UnlockRequest{Key: []byte("lc-none")})
	outcome("unlock of a key that is not there", err)

	// A waiter whose client gives up.
	l4, l5 := c.grant(30), c.grant(30)
	held, _ := c.lock.Lock(ctx(), &v3lockpb.LockRequest{Name: []byte("lc-c"), Lease: l4})
	short, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	_, err = c.lock.Lock(short, &v3lockpb.LockRequest{Name: []byte("lc-c"), Lease: l5})
	cancel()
	outcome("lock given up by its client", err)
	time.Sleep(time.Second)
	say("given-up waiter's key left: %v; holder's key left: %v", c.exists([]byte(keyOf("lc-c", l5))), c.exists(held.Key))
}

func (c *checker) elections() {
	_, err := c.elect.Leader(ctx(), &v3electionpb.LeaderRequest{Name: []byte("lc-e")})
	outcome("leader with none", err)
	obsCtx, stopObserve := context.WithCancel(context.Background())
	defer stopObserve()
	obs, err := c.elect.Observe(obsCtx, &v3electionpb.LeaderRequest{Name: []byte("lc-e")})
	outcome("observe", err)
	seen := make(chan string, 64)
	go func() {
		for {
			m, err := obs.Recv()
			if err != nil {
				s, _ := status.FromError(err)
				seen <- fmt.Sprintf("end %s", s.Code())
				return
			}
			seen <- fmt.Sprintf("%s (header revision %s mod revision)", m.Kv.Value,
				map[bool]string{true: "=", false: "!="}[m.Header.Revision == m.Kv.ModRevision])
		}
	}()
	time.Sleep(200 * time.Millisecond)

	l1, l2 := c.grant(30), c.grant(30)
	w1, err := c.elect.Campaign(ctx(), &v3electionpb.CampaignRequest{Name: []byte("lc-e"), Lease: l1, Value: []byte("v1")})
	outcome("campaign", err)
	k := w1.Leader
	say("leader key: name %q, key is name/hex(lease) %v, rev = header %v, lease %v",
		k.Name, string(k.Key) == keyOf("lc-e", l1), k.Rev == w1.Header.Revision, k.Lease == l1)
	type campaigned struct {
		resp *v3electionpb.CampaignResponse
		err  error
	}
	second := make(chan campaigned, 1)
	go func() {
		r, err := c.elect.Campaign(ctx(), &v3electionpb.CampaignRequest{Name: []byte("lc-e"), Lease: l2, Value: []byte("v2")})
		second <- campaigned{r, err}
	}()
	say("second campaigner waits: %v", waiting(second))
	_, err = c.elect.Proclaim(ctx(), &v3electionpb.ProclaimRequest{Leader: k, Value: []byte("v1b")})
	outcome("proclaim", err)
	ld, err := c.elect.Leader(ctx(), &v3electionpb.LeaderRequest{Name: []byte("lc-e")})
	outcome("leader", err)
	say("leader value %s, header revision = mod revision %v", ld.Kv.Value, ld.Header.Revision == ld.Kv.ModRevision)
	_, err = c.elect.Proclaim(ctx(), &v3electionpb.ProclaimRequest{
		Leader: &v3electionpb.LeaderKey{Name: []byte("lc-e"), Key: []byte(keyOf("lc-e", l2)), Rev: k.Rev, Lease: l2}, Value: []byte("x")})
	outcome("proclaim by a non-leader", err)
	_, err = c.elect.Proclaim(ctx(), &v3electionpb.ProclaimRequest{Value: []byte("x")})
	outcome("proclaim without a leader key", err)
	_, err = c.elect.Resign(ctx(), &v3electionpb.ResignRequest{})
	outcome("resign without a leader key", err)
	_, err = c.elect.Resign(ctx(), &v3electionpb.ResignRequest{Leader: k})
	outcome("resign", err)
	got := <-second
	outcome("second campaign", got.err)
	w2 := got.resp
	say("second header revision above the first: %v", w2.Header.Revision > w1.Header.Revision)
	_, err = c.elect.Resign(ctx(), &v3electionpb.ResignRequest{Leader: k})
	outcome("resign again with the old key", err)
	_, err = c.elect.Proclaim(ctx(), &v3electionpb.ProclaimRequest{Leader: k, Value: []byte("x")})
	outcome("proclaim with the old key", err)
	_, err = c.elect.Proclaim(ctx(), &v3electionpb.ProclaimRequest{Leader: w2.Leader, Value: []byte("v2b")})
	outcome("proclaim by the new leader", err)
	// The same lease campaigns again with another value: it keeps its place, with the value.
	again, err := c.elect.Campaign(ctx(), &v3electionpb.CampaignRequest{Name: []byte("lc-e"), Lease: l2, Value: []byte("v2c")})
	outcome("campaign again with the leader's lease", err)
	say("same key and rev: %v", err == nil && string(again.Leader.Key) == string(w2.Leader.Key) && again.Leader.Rev == w2.Leader.Rev)
	_, err = c.lease.LeaseRevoke(ctx(), &pb.LeaseRevokeRequest{ID: l2})
	outcome("revoke the leader's lease", err)
	_, err = c.elect.Leader(ctx(), &v3electionpb.LeaderRequest{Name: []byte("lc-e")})
	outcome("leader after the revoke", err)

	// A campaigner whose client gives up.
	l3, l4 := c.grant(30), c.grant(30)
	c.elect.Campaign(ctx(), &v3electionpb.CampaignRequest{Name: []byte("lc-e"), Lease: l3, Value: []byte("v3")})
	short, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	_, err = c.elect.Campaign(short, &v3electionpb.CampaignRequest{Name: []byte("lc-e"), Lease: l4, Value: []byte("v4")})
	cancel()
	outcome("campaign given up by its client", err)
	time.Sleep(time.Second)
	say("given-up campaigner's key left: %v", c.exists([]byte(keyOf("lc-e", l4))))
	w0, err := c.elect.Campaign(ctx(), &v3electionpb.CampaignRequest{Name: []byte("lc-f"), Value: []byte("z")})
	outcome("campaign with no lease", err)
	ttl, _ := c.lease.LeaseTimeToLive(ctx(), &pb.LeaseTimeToLiveRequest{ID: w0.Leader.Lease})
	say("campaign session lease ttl: %d", ttl.GrantedTTL)

	time.Sleep(300 * time.Millisecond)
	stopObserve()
	for done := false; !done; {
		select {
		case s := <-seen:
			say("observed %s", s)
		case <-time.After(time.Second):
			done = true
		}
	}
}

func (c *checker) withAuth() {
	c.auth.UserAdd(ctx(), &pb.AuthUserAddRequest{Name: "root", Password: "rootpw"})
	c.auth.UserGrantRole(ctx(), &pb.AuthUserGrantRoleRequest{User: "root", Role: "root"})
	l := c.grant(30)
	_, err := c.auth.AuthEnable(ctx(), &pb.AuthEnableRequest{})
	outcome("auth enable", err)
	_, err = c.lock.Lock(ctx(), &v3lockpb.LockRequest{Name: []byte("lc-x"), Lease: l})
	outcome("lock without a token", err)
	_, err = c.elect.Leader(ctx(), &v3electionpb.LeaderRequest{Name: []byte("lc-x")})
	outcome("leader without a token", err)
	_, err = c.elect.Campaign(ctx(), &v3electionpb.CampaignRequest{Name: []byte("lc-x"), Value: []byte("v")})
	outcome("campaign with no lease and no token", err)
	tok, err := c.auth.Authenticate(ctx(), &pb.AuthenticateRequest{Name: "root", Password: "rootpw"})
	if err != nil {
		panic(err)
	}
	root := metadata.AppendToOutgoingContext(ctx(), "token", tok.Token)
	_, err = c.lock.Lock(root, &v3lockpb.LockRequest{Name: []byte("lc-x"), Lease: l})
	outcome("lock as root", err)
	_, err = c.auth.AuthDisable(root, &pb.AuthDisableRequest{})
	outcome("auth disable", err)
}
