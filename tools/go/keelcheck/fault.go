package main

// keelcheck fault: a cluster of server processes, a random put/get/cas workload from several
// clients, one process fault per round, then a porcupine linearizability check of the whole
// history (final reads of every key included) and a plain lost-write check.

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math/rand"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/debug"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/anishathalye/porcupine"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
)

type stringList []string

func (s *stringList) String() string     { return strings.Join(*s, " ") }
func (s *stringList) Set(v string) error { *s = append(*s, v); return nil }

type faultConfig struct {
	serverBin         string
	nodes             int
	rounds            int
	roundSecs         float64
	clients           int
	keys              int
	workdir           string
	basePort          int
	seed              int64
	faults            []string
	serverArgs        stringList
	preArgs           stringList
	opTimeout         time.Duration
	downTime          time.Duration
	recover           time.Duration
	checkTimeout      time.Duration
	restartState      string
	injectBug         string
	maxOps            int
	netns             bool
	partitionTime     time.Duration
	workload          string
	watchers          int
	mutexTTL          int
	mutexAllowExpired bool
	curpPercent       int
}

// keyPrefix is the prefix of every key the kv workload writes.
const keyPrefix = "keelcheck/"

var knownFaults = map[string]bool{"kill-leader": true, "kill-follower": true, "kill-all": true, "restart": true, "none": true}

type recorder struct {
	start    time.Time
	mu       sync.Mutex
	ops      []porcupine.Operation
	clientID atomic.Int64
	ok       atomic.Int64
	unknown  atomic.Int64
	// writes, when set, hears of every write attempted and of its revision once acknowledged
	// (revision 0: not acknowledged); the watch check compares events with them.
	writes *writeLog
	// answers holds every acknowledged answer's header for the header-revision checks.
	answers *answerLog
}

// serializableGets (--inject-bug serializable) makes the workload's reads serializable: a
// member answers from its own state, so a partitioned or lagging member can answer stale
// values, and a run with network faults must then fail; unlike read and lost it changes what
// the servers are asked, not the record. The final reads stay linearizable.
var serializableGets bool

func (r *recorder) now() int64 { return int64(time.Since(r.start)) }

func (r *recorder) add(op porcupine.Operation) {
	r.mu.Lock()
	r.ops = append(r.ops, op)
	r.mu.Unlock()
	if op.Output.(kvOutput).Unknown {
		r.unknown.Add(1)
	} else {
		r.ok.Add(1)
	}
}

// opMode says how an operation is sent and where it is recorded.
type opMode struct {
	serializable bool // a get served from the member's own state
	prefix       bool // a get of every key under in.Key (a range), outside porcupine's model
	prevKV       bool // a put asking for the previous key-value
	outsideModel bool // recorded for the header checks only, not in porcupine's history
}

// label names an operation in the header checks' reports.
func (m opMode) label(in kvInput) string {
	switch {
	case in.Kind == opGet && m.prefix:
		return "range"
	case in.Kind == opGet && m.serializable:
		return "serializable-get"
	case in.Kind == opPut && m.prevKV:
		return "put+prev_kv"
	}
	return in.Kind.String()
}

// do runs one operation and records it. An error or timeout makes its outcome unknown.
func (r *recorder) do(cli *clientv3.Client, clientID int, in kvInput, timeout time.Duration, mode opMode) (kvOutput, bool) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	call := r.now()
	out, header, body, err := r.send(ctx, cli, in, mode)
	ret := r.now()
	if err != nil {
		out = kvOutput{Unknown: true}
		ret = infinity
	} else {
		class := classLinearizable
		if mode.serializable {
			class = classSerializable
		}
		r.answers.add(newAnswer(mode.label(in), in.Key, clientID, call, ret, header, body, class))
	}
	if !mode.outsideModel {
		r.add(porcupine.Operation{ClientId: clientID, Input: in, Call: call, Output: out, Return: ret})
	}
	return out, err == nil
}

// send sends one operation; it returns what the model sees, and the answer's header and body
// for the header checks.
func (r *recorder) send(ctx context.Context, cli *clientv3.Client, in kvInput, mode opMode) (out kvOutput, header *pb.ResponseHeader, body any, err error) {
	switch in.Kind {
	case opPut:
		r.writes.attempt(in.Value)
		var opts []clientv3.OpOption
		if mode.prevKV {
			opts = append(opts, clientv3.WithPrevKV())
		}
		resp, err := cli.Put(ctx, in.Key, in.Value, opts...)
		if err != nil {
			return out, nil, nil, err
		}
		r.writes.acked(in.Key, in.Value, resp.Header.Revision)
		return out, resp.Header, (*pb.PutResponse)(resp), nil
	case opGet:
		var opts []clientv3.OpOption
		if mode.serializable {
			opts = append(opts, clientv3.WithSerializable())
		}
		if mode.prefix {
			opts = append(opts, clientv3.WithPrefix())
		}
		resp, err := cli.Get(ctx, in.Key, opts...) // linearizable unless serializable
		if err != nil {
			return out, nil, nil, err
		}
		if len(resp.Kvs) > 0 && !mode.prefix {
			out.Found, out.Value = true, string(resp.Kvs[0].Value)
		}
		return out, resp.Header, (*pb.RangeResponse)(resp), nil
	case opCAS:
		r.writes.attempt(in.Value)
		resp, err := cli.Txn(ctx).
			If(clientv3.Compare(clientv3.Value(in.Key), "=", in.Expect)).
			Then(clientv3.OpPut(in.Key, in.Value)).
			Else(clientv3.OpGet(in.Key)).
			Commit()
		if err != nil {
			return out, nil, nil, err
		}
		out.Succeeded = resp.Succeeded
		if resp.Succeeded {
			r.writes.acked(in.Key, in.Value, resp.Header.Revision)
		} else if len(resp.Responses) != 1 || resp.Responses[0].GetResponseRange() == nil {
			return out, nil, nil, fmt.Errorf("txn else branch: want one range response, got %v", resp.Responses)
		} else if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 {
			out.Found, out.Value = true, string(kvs[0].Value)
		}
		return out, resp.Header, (*pb.TxnResponse)(resp), nil
	}
	return out, nil, nil, fmt.Errorf("unknown operation kind %v", in.Kind)
}

// doCurp runs a put through the CURP session cc and records it like any other put. An
// answer on the fast path that carries no revision takes no part in the header checks.
func (r *recorder) doCurp(cc *curpClient, clientID int, in kvInput, timeout time.Duration) (kvOutput, bool) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	call := r.now()
	fast, resp, err := cc.put(ctx, in.Key, in.Value)
	out, ret := kvOutput{}, r.now()
	if err != nil {
		out, ret = kvOutput{Unknown: true}, infinity
	} else {
		op, class := "curp-put", classLinearizable
		if fast {
			op = "curp-put-fast"
			if resp.GetHeader().GetRevision() == 0 {
				class = classNoRevision
			}
		}
		r.answers.add(newAnswer(op, in.Key, clientID, call, ret, resp.GetHeader(), resp, class))
	}
	r.add(porcupine.Operation{ClientId: clientID, Input: in, Call: call, Output: out, Return: ret})
	return out, err == nil
}

func runFault(args []string) int {
	var cfg faultConfig
	fs := flag.NewFlagSet("fault", flag.ContinueOnError)
	fs.StringVar(&cfg.serverBin, "server-bin", "", "server binary taking etcd's member flags (etcd, or a wrapper running `keel serve`)")
	fs.IntVar(&cfg.nodes, "nodes", 3, "cluster size")
	fs.IntVar(&cfg.rounds, "rounds", 5, "rounds, one fault each")
	fs.Float64Var(&cfg.roundSecs, "round-secs", 10, "workload seconds per round")
	fs.IntVar(&cfg.clients, "clients", 8, "concurrent clients")
	fs.IntVar(&cfg.keys, "keys", 10, "number of keys")
	fs.StringVar(&cfg.workdir, "workdir", "", "directory for data dirs, server logs, history.json and violation.html")
	fs.IntVar(&cfg.basePort, "base-port", 23790, "node i (0-based) listens on client port P+2i and peer port P+2i+1")
	fs.Int64Var(&cfg.seed, "seed", 0, "random seed (0: from the clock; printed)")
	faults := fs.String("faults", "kill-leader,kill-follower,kill-all,restart", "faults, used in turn one per round: kill-leader,kill-follower,kill-all,restart,none; with --netns also isolate-leader,isolate-follower,split,bridge,one-way,delay (default there: "+defaultNetnsFaults+")")
	fs.BoolVar(&cfg.netns, "netns", false, "as root: each member in its own network namespace behind a bridge, with nftables partitions and proxy delays as faults")
	// keel's failover takes 3-7 s (openraft's leader lease is election_timeout_max = 2 s, so the
	// first candidate is usually refused); 5 s makes most isolations elect a new leader before
	// the heal while some heal first, and both cases are worth having.
	fs.DurationVar(&cfg.partitionTime, "partition-time", 5*time.Second, "with --netns: a network fault is held for a seeded time in [t/2, 3t/2]")
	fs.Var(&cfg.serverArgs, "server-arg", "extra argument for every server process, after the member flags (repeatable)")
	fs.Var(&cfg.preArgs, "server-pre-arg", "argument before the member flags, e.g. serve for `keel serve` (repeatable)")
	fs.DurationVar(&cfg.opTimeout, "op-timeout", 2*time.Second, "timeout of one client operation")
	fs.DurationVar(&cfg.downTime, "down-time", 1500*time.Millisecond, "how long killed nodes stay down")
	fs.DurationVar(&cfg.recover, "recover-timeout", 60*time.Second, "how long a cluster may take to have every node up and one leader")
	fs.DurationVar(&cfg.checkTimeout, "check-timeout", 5*time.Minute, "total time limit of the linearizability check")
	fs.StringVar(&cfg.restartState, "restart-cluster-state", "", "--initial-cluster-state on restarts (default: the same flags as the first start, i.e. new)")
	fs.IntVar(&cfg.maxOps, "max-ops-per-client-round", 100000, "upper bound of operations per client per round")
	fs.StringVar(&cfg.injectBug, "inject-bug", "", "testing the checker: 'read' corrupts one recorded read, 'lost' makes one final read stale, 'header' lowers one recorded answer's header revision below a mod_revision in its body, 'serializable' sends the workload's reads as serializable (local, possibly stale) reads, which faults must expose; with --watchers, 'watch-drop' and 'watch-dup' drop or repeat one event watcher 0 received; with --workload mutex, 'mutex-skip' makes client 0 enter every tenth section without the lock")
	fs.StringVar(&cfg.workload, "workload", "kv", "kv: put/get/cas checked by porcupine (and by watchers with --watchers); mutex: clientv3 concurrency.Mutex from --clients sessions, checked for two holders at once")
	fs.IntVar(&cfg.watchers, "watchers", 0, "kv workload: watchers of every key from revision 1, on different members, whose events are checked against the acknowledged writes (exactly once, in revision order, none missing)")
	fs.IntVar(&cfg.mutexTTL, "mutex-ttl", 10, "mutex workload: session lease TTL in seconds")
	fs.IntVar(&cfg.curpPercent, "curp-percent", 0, "kv workload against keel: percent of puts sent through keel's CURP extension (fast path: one round trip), checked with the rest by porcupine")
	fs.BoolVar(&cfg.mutexAllowExpired, "mutex-allow-expired", false, "mutex workload: do not fail when a session's lease ends while its holder is inside")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if cfg.workload != "kv" && cfg.workload != "mutex" {
		fmt.Fprintln(os.Stderr, "keelcheck fault: --workload is kv or mutex")
		return 2
	}
	if cfg.serverBin == "" || cfg.workdir == "" || cfg.nodes < 1 || cfg.rounds < 0 || cfg.clients < 1 || cfg.keys < 1 || cfg.roundSecs <= 0 {
		fmt.Fprintln(os.Stderr, "keelcheck fault: --server-bin and --workdir are required; --nodes, --clients, --keys, --round-secs must be positive")
		return 2
	}
	faultsSet := false
	fs.Visit(func(f *flag.Flag) { faultsSet = faultsSet || f.Name == "faults" })
	if cfg.netns && !faultsSet {
		*faults = defaultNetnsFaults
	}
	for _, f := range strings.Split(*faults, ",") {
		f = strings.TrimSpace(f)
		if netFaults[f] && !cfg.netns {
			fmt.Fprintf(os.Stderr, "keelcheck fault: %s needs --netns\n", f)
			return 2
		}
		if !knownFaults[f] && !netFaults[f] {
			fmt.Fprintf(os.Stderr, "keelcheck fault: unknown fault %q\n", f)
			return 2
		}
		cfg.faults = append(cfg.faults, f)
	}
	switch cfg.injectBug {
	case "", "read", "lost", "header", "watch-drop", "watch-dup", "mutex-skip":
	case "serializable":
		serializableGets = true
	default:
		fmt.Fprintln(os.Stderr, "keelcheck fault: --inject-bug is read, lost, header, serializable, watch-drop, watch-dup or mutex-skip")
		return 2
	}
	if cfg.netns {
		if err := checkNetnsTools(); err != nil {
			fmt.Fprintln(os.Stderr, "keelcheck fault:", err)
			return 2
		}
	}
	if cfg.seed == 0 {
		cfg.seed = time.Now().UnixNano() % 1_000_000_000
	}
	if p, err := filepath.Abs(cfg.serverBin); err == nil {
		cfg.serverBin = p
	}
	if err := os.MkdirAll(cfg.workdir, 0o755); err != nil {
		fmt.Fprintln(os.Stderr, "keelcheck fault:", err)
		return 2
	}
	// A fresh cluster every run: remove only what keelcheck itself makes there.
	for i := 1; i <= cfg.nodes; i++ {
		_ = os.RemoveAll(filepath.Join(cfg.workdir, fmt.Sprintf("n%d.data", i)))
		_ = os.Remove(filepath.Join(cfg.workdir, fmt.Sprintf("n%d.log", i)))
	}
	_ = os.Remove(filepath.Join(cfg.workdir, "violation.html"))

	// Servers and namespaces never outlive keelcheck: on return, on panic (here or in a
	// goroutine, via guard), and on SIGINT/SIGTERM/SIGHUP. The handler is in place before the
	// first namespace exists.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	go func() {
		s := <-sigs
		fmt.Fprintf(os.Stderr, "keelcheck: %v: killing servers, removing namespaces\n", s)
		cleanupAll()
		os.Exit(130)
	}()
	defer cleanupAll()
	defer func() {
		if r := recover(); r != nil {
			cleanupAll()
			panic(r)
		}
	}()
	var lab *netLab
	if cfg.netns {
		var err error
		lab, err = newNetLab(cfg.nodes)
		guardMu.Lock()
		guardLab = lab
		guardMu.Unlock()
		if err != nil {
			fmt.Fprintln(os.Stderr, "keelcheck fault: network namespaces:", err)
			return 2
		}
		clientDialOptions = append(clientDialOptions, grpc.WithContextDialer(lab.grpcDialer))
		fmt.Printf("keelcheck: netns lab %s-{hub,n1..n%d}: members %s.0.1..%d, clients from %s\n",
			lab.prefix, cfg.nodes, labSubnet, cfg.nodes, lab.hubAddr())
	}
	c := newCluster(cfg.serverBin, cfg.workdir, cfg.nodes, cfg.basePort, cfg.preArgs, cfg.serverArgs, cfg.restartState, lab)
	guardMu.Lock()
	guardCluster = c
	guardMu.Unlock()
	return faultMain(cfg, c)
}

var (
	guardMu      sync.Mutex
	guardCluster *cluster
	guardLab     *netLab
)

// cleanupAll kills the servers, then removes the namespaces (a namespace's processes go
// first so that nothing keeps it alive). Safe to call more than once.
func cleanupAll() {
	guardMu.Lock()
	c, lab := guardCluster, guardLab
	guardMu.Unlock()
	if c != nil {
		c.killAll()
	}
	if lab != nil {
		lab.teardown()
	}
}

// guard is deferred first in every goroutine: a panic anywhere still kills the servers and
// removes the namespaces.
func guard() {
	if r := recover(); r != nil {
		fmt.Fprintf(os.Stderr, "keelcheck: panic: %v\n%s", r, debug.Stack())
		cleanupAll()
		os.Exit(70)
	}
}

func faultMain(cfg faultConfig, c *cluster) int {
	ctx := context.Background()
	rng := rand.New(rand.NewSource(cfg.seed))
	fmt.Printf("keelcheck: seed=%d server=%s nodes=%d workdir=%s endpoints=%s\n", cfg.seed, cfg.serverBin, cfg.nodes, cfg.workdir, strings.Join(c.endpoints(), ","))
	for i := range c.nodes {
		if err := c.start(i); err != nil {
			fmt.Fprintln(os.Stderr, "keelcheck:", err)
			return 2
		}
	}
	t0 := time.Now()
	if _, err := c.waitHealthy(ctx, cfg.recover); err != nil {
		fmt.Fprintf(os.Stderr, "keelcheck: cluster never became healthy: %v\n", err)
		fmt.Printf("keelcheck: rounds=0 ops=0 ok=0 unknown=0 violations=0 lost=0 seed=%d recovered=no\n", cfg.seed)
		return 3
	}
	fmt.Printf("keelcheck: cluster up with a leader in %.1fs\n", time.Since(t0).Seconds())
	if cfg.workload == "mutex" {
		return mutexMain(cfg, c, rng)
	}

	keys := make([]string, cfg.keys)
	for i := range keys {
		keys[i] = fmt.Sprintf("%sk%03d", keyPrefix, i)
	}
	rec := &recorder{start: time.Now(), answers: &answerLog{}}
	var watchers []*watchChecker
	watchCtx, stopWatchers := context.WithCancel(ctx)
	defer stopWatchers()
	if cfg.watchers > 0 {
		rec.writes = newWriteLog()
		watchers = startWatchers(watchCtx, cfg.watchers, c.endpoints(), keyPrefix, rec.now)
	}
	var valueSeq atomic.Int64
	clis := make([]*clientv3.Client, cfg.clients)
	for i := range clis {
		// Rotate the endpoint list so clients start on different members.
		eps := c.endpoints()
		eps = append(eps[i%len(eps):], eps[:i%len(eps)]...)
		cli, err := newClient(eps, 2*time.Second)
		if err != nil {
			fmt.Fprintln(os.Stderr, "keelcheck: client:", err)
			return 2
		}
		clis[i] = cli
	}
	rec.clientID.Store(int64(cfg.clients))
	lastSeen := make([]map[string]string, cfg.clients) // per client: a value it saw or wrote per key
	for i := range lastSeen {
		lastSeen[i] = map[string]string{}
	}
	clientRngs := make([]*rand.Rand, cfg.clients)
	for i := range clientRngs {
		clientRngs[i] = rand.New(rand.NewSource(cfg.seed*1000 + int64(i)))
	}
	clientIDs := make([]int, cfg.clients)
	for i := range clientIDs {
		clientIDs[i] = i
	}
	if cfg.curpPercent > 0 && cfg.watchers > 0 {
		fmt.Fprintln(os.Stderr, "keelcheck: --curp-percent and --watchers do not go together (a fast write has no revision to compare)")
		return 2
	}
	curps := make([]*curpClient, cfg.clients)
	for i := range curps {
		if cfg.curpPercent == 0 {
			break
		}
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		cc, err := newCurpClient(cctx, clis[i], rand.New(rand.NewSource(cfg.seed*7919+int64(i))))
		cancel()
		if err != nil {
			fmt.Fprintln(os.Stderr, "keelcheck: curp client:", err)
			return 2
		}
		curps[i] = cc
	}

	recovered := true
	rounds := 0
	for r := 0; r < cfg.rounds; r++ {
		fault := cfg.faults[r%len(cfg.faults)]
		roundDur := time.Duration(cfg.roundSecs * float64(time.Second))
		roundEnd := time.Now().Add(roundDur)
		okBefore, unkBefore := rec.ok.Load(), rec.unknown.Load()
		var wg sync.WaitGroup
		for ci := 0; ci < cfg.clients; ci++ {
			wg.Add(1)
			go func(ci int) {
				defer guard()
				defer wg.Done()
				rn := clientRngs[ci]
				for n := 0; n < cfg.maxOps && time.Now().Before(roundEnd); n++ {
					key := keys[rn.Intn(len(keys))]
					var in kvInput
					mode := opMode{serializable: serializableGets}
					// Serializable gets and ranges over every key are for the header checks
					// only: porcupine's model is per key and needs linearizable reads.
					switch p := rn.Intn(100); {
					case p < 40:
						in = kvInput{Kind: opPut, Key: key, Value: fmt.Sprintf("v%d", valueSeq.Add(1))}
						mode.prevKV = rn.Intn(2) == 0
					case p < 70:
						in = kvInput{Kind: opGet, Key: key}
					case p < 75:
						in = kvInput{Kind: opGet, Key: key}
						mode.serializable, mode.outsideModel = true, true
					case p < 77:
						in = kvInput{Kind: opGet, Key: keyPrefix}
						mode.prefix, mode.outsideModel = true, true
					default:
						exp, ok := lastSeen[ci][key]
						if !ok {
							exp = "never-written"
						}
						in = kvInput{Kind: opCAS, Key: key, Expect: exp, Value: fmt.Sprintf("v%d", valueSeq.Add(1))}
					}
					var out kvOutput
					var ok bool
					if in.Kind == opPut && curps[ci] != nil && rn.Intn(100) < cfg.curpPercent {
						out, ok = rec.doCurp(curps[ci], clientIDs[ci], in, cfg.opTimeout)
					} else {
						out, ok = rec.do(clis[ci], clientIDs[ci], in, cfg.opTimeout, mode)
					}
					if mode.outsideModel {
						continue
					}
					if !ok {
						// The unknown op stays pending forever: later ops of this client get a
						// fresh id so the visualization shows them on their own line.
						clientIDs[ci] = int(rec.clientID.Add(1))
						continue
					}
					switch {
					case in.Kind == opPut || (in.Kind == opCAS && out.Succeeded):
						lastSeen[ci][key] = in.Value
					case out.Found:
						lastSeen[ci][key] = out.Value
					}
				}
			}(ci)
		}
		// The fault, a third of the way into the round.
		time.Sleep(roundDur / 3)
		desc, err := injectFault(ctx, c, cfg, fault, rng)
		if err != nil {
			fmt.Fprintf(os.Stderr, "keelcheck: round %d: fault %s: %v\n", r+1, fault, err)
		}
		wg.Wait()
		rounds++
		t := time.Now()
		_, herr := c.waitHealthy(ctx, cfg.recover)
		fmt.Printf("keelcheck: round %d/%d fault=%s (%s) ok=%d unknown=%d recovered=%v in %.1fs\n",
			r+1, cfg.rounds, fault, desc, rec.ok.Load()-okBefore, rec.unknown.Load()-unkBefore, herr == nil, time.Since(t).Seconds())
		if herr != nil {
			fmt.Fprintf(os.Stderr, "keelcheck: round %d: server never recovered: %v\n", r+1, herr)
			c.dumpStacks(fmt.Sprintf("round %d: not healthy", r+1))
			recovered = false
			break
		}
	}

	// Final reads: every key, linearizably, through every member.
	finals := map[string]kvOutput{}
	finalIdx := map[string][]int{}
	if recovered {
		for _, nd := range c.nodes {
			cli, err := newClient([]string{nd.clientURL}, 2*time.Second)
			if err != nil {
				fmt.Fprintln(os.Stderr, "keelcheck: final client:", err)
				continue
			}
			id := int(rec.clientID.Add(1))
			for _, k := range keys {
				for attempt := 0; attempt < 10; attempt++ {
					out, ok := rec.do(cli, id, kvInput{Kind: opGet, Key: k}, 5*time.Second, opMode{})
					if ok {
						finals[k] = out
						rec.mu.Lock()
						finalIdx[k] = append(finalIdx[k], len(rec.ops)-1)
						rec.mu.Unlock()
						break
					}
					id = int(rec.clientID.Add(1))
					time.Sleep(200 * time.Millisecond)
				}
			}
			cli.Close()
		}
		for _, k := range keys {
			if _, ok := finals[k]; !ok {
				fmt.Fprintf(os.Stderr, "keelcheck: no final read of %s succeeded on any member\n", k)
				recovered = false
			}
		}
	}
	watchAnomalies, watchEvents, watchGaps := 0, 0, 0
	if len(watchers) > 0 {
		finalRev := int64(-1)
		if recovered {
			for attempt := 0; attempt < 10 && finalRev < 0; attempt++ {
				wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				resp, err := clis[0].Get(wctx, keys[0])
				cancel()
				if err == nil {
					finalRev = resp.Header.Revision
				}
			}
		}
		waitCaughtUp(watchers, finalRev, 30*time.Second)
		stopWatchers()
		injectWatchBug(cfg.injectBug, watchers[0])
		watchAnomalies, watchEvents, watchGaps = checkWatchers(watchers, rec.writes, finalRev, finals)
		fmt.Printf("keelcheck: watchers=%d watch-events=%d watch-gaps=%d watch-anomalies=%d\n", len(watchers), watchEvents, watchGaps, watchAnomalies)
	}
	for _, cli := range clis {
		cli.Close()
	}
	c.killAll()

	history := rec.ops
	if cfg.injectBug == "read" || cfg.injectBug == "lost" {
		injectBug(cfg.injectBug, history, finals, finalIdx)
	}
	writeHistory(filepath.Join(cfg.workdir, "history.json"), history)

	lost := lostWrites(history, finals)
	for i, l := range lost {
		if i == 10 {
			fmt.Fprintf(os.Stderr, "keelcheck: lost: ... and %d more\n", len(lost)-10)
			break
		}
		fmt.Fprintln(os.Stderr, "keelcheck: lost:", l)
	}
	answers := rec.answers.list
	if cfg.injectBug == "header" {
		injectHeaderBug(answers)
	}
	writeAnswers(filepath.Join(cfg.workdir, "answers.json"), answers)
	headers := checkHeaders(answers, allReceipts(watchers), c.incarnations(rec.start))
	headers.print()
	tc := time.Now()
	violations, undecided := checkHistory(history, cfg)
	fmt.Printf("keelcheck: checked %d operations (%d after pruning) in %.1fs\n", len(history), len(pruneHistory(history)), time.Since(tc).Seconds())
	fmt.Printf("keelcheck: rounds=%d ops=%d ok=%d unknown=%d violations=%d lost=%d header-violations=%d seed=%d recovered=%v check=%s\n",
		rounds, len(history), rec.ok.Load(), rec.unknown.Load(), violations, len(lost), headers.violations(), cfg.seed,
		yesNo(recovered), map[bool]string{true: "incomplete", false: "complete"}[undecided > 0])
	curpFast, curpSlow := 0, 0
	for _, cc := range curps {
		if cc != nil {
			curpFast, curpSlow = curpFast+cc.fast, curpSlow+cc.slow
		}
	}
	if cfg.curpPercent > 0 {
		fmt.Printf("keelcheck: curp puts acknowledged: fast=%d slow=%d\n", curpFast, curpSlow)
	}
	switch {
	case violations > 0 || len(lost) > 0 || watchAnomalies > 0 || headers.violations() > 0:
		return 1
	case cfg.curpPercent > 0 && curpFast == 0:
		fmt.Fprintln(os.Stderr, "keelcheck: --curp-percent given but no put completed on the fast path: the run did not exercise it")
		return 1
	case !recovered:
		return 3
	case undecided > 0:
		fmt.Fprintf(os.Stderr, "keelcheck: the check of %d keys did not finish within --check-timeout %v\n", undecided, cfg.checkTimeout)
		return 4
	}
	return 0
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

func injectFault(ctx context.Context, c *cluster, cfg faultConfig, fault string, rng *rand.Rand) (string, error) {
	if fault == "none" {
		return "nothing", nil
	}
	if netFaults[fault] {
		return injectNetFault(ctx, c, cfg, fault, rng)
	}
	v, err := c.waitHealthy(ctx, cfg.recover)
	if err != nil && fault != "kill-all" && fault != "restart" {
		return "skipped", fmt.Errorf("no leader to pick a victim: %w", err)
	}
	switch fault {
	case "kill-leader", "kill-follower":
		victim := v.leaderIdx
		if fault == "kill-follower" {
			var fol []int
			for i := range c.nodes {
				if i != v.leaderIdx {
					fol = append(fol, i)
				}
			}
			if len(fol) == 0 {
				return "skipped", errors.New("no follower in a one-node cluster")
			}
			victim = fol[rng.Intn(len(fol))]
		}
		c.stop(victim, syscall.SIGKILL, 0)
		time.Sleep(cfg.downTime)
		return "kill -9 " + c.nodes[victim].name, c.start(victim)
	case "kill-all":
		c.killAll()
		time.Sleep(cfg.downTime)
		for i := range c.nodes {
			if err := c.start(i); err != nil {
				return "kill -9 all", err
			}
		}
		return "kill -9 all", nil
	case "restart":
		// Rolling restart: SIGTERM one member, start it again, wait until it answers.
		for i := range c.nodes {
			c.stop(i, syscall.SIGTERM, 10*time.Second)
			if err := c.start(i); err != nil {
				return "rolling restart", err
			}
			deadline := time.Now().Add(cfg.recover)
			for {
				if _, err := status(ctx, c.nodes[i].clientURL, time.Second); err == nil {
					break
				}
				if time.Now().After(deadline) || !c.running(i) {
					return "rolling restart", fmt.Errorf("%s did not come back", c.nodes[i].name)
				}
				time.Sleep(200 * time.Millisecond)
			}
		}
		return "rolling restart (SIGTERM)", nil
	}
	return "", fmt.Errorf("unknown fault %q", fault)
}

// checkHistory checks each key's operations with porcupine within the total time limit.
// It returns how many keys are not linearizable and how many could not be decided in time.
// On a violation it writes porcupine's visualization of the bad keys to workdir.
func checkHistory(history []porcupine.Operation, cfg faultConfig) (violations, undecided int) {
	pruned := pruneHistory(history)
	single := kvModel
	single.Partition = nil
	deadline := time.Now().Add(cfg.checkTimeout)
	var bad []porcupine.Operation
	var badKeys []string
	for _, part := range partitionByKey(pruned) {
		left := time.Until(deadline)
		if left <= 0 {
			undecided++
			continue
		}
		switch porcupine.CheckOperationsTimeout(single, part, left) {
		case porcupine.Illegal:
			violations++
			badKeys = append(badKeys, part[0].Input.(kvInput).Key)
			bad = append(bad, part...)
		case porcupine.Unknown:
			undecided++
		}
	}
	if violations > 0 {
		fmt.Fprintf(os.Stderr, "keelcheck: not linearizable: %s\n", strings.Join(badKeys, " "))
		_, info := porcupine.CheckOperationsVerbose(kvModel, bad, time.Minute)
		path := filepath.Join(cfg.workdir, "violation.html")
		if err := porcupine.VisualizePath(kvModel, info, path); err != nil {
			fmt.Fprintln(os.Stderr, "keelcheck: visualization:", err)
		} else {
			fmt.Fprintf(os.Stderr, "keelcheck: visualization of the violating keys: %s\n", path)
		}
	}
	return violations, undecided
}

// injectBug corrupts the recorded history so that a correct checker must fail; it tests
// keelcheck itself, never the server.
func injectBug(kind string, history []porcupine.Operation, finals map[string]kvOutput, finalIdx map[string][]int) {
	switch kind {
	case "read":
		var gets []int
		for i, op := range history {
			in, out := op.Input.(kvInput), op.Output.(kvOutput)
			if in.Kind == opGet && !out.Unknown {
				gets = append(gets, i)
			}
		}
		if len(gets) == 0 {
			fmt.Fprintln(os.Stderr, "keelcheck: inject-bug: no successful read to corrupt")
			return
		}
		i := gets[len(gets)/2]
		out := history[i].Output.(kvOutput)
		out.Found, out.Value = true, "injected-bug"
		history[i].Output = out
		fmt.Fprintf(os.Stderr, "keelcheck: inject-bug: read of %s now returns a value never written\n", history[i].Input.(kvInput).Key)
	case "lost":
		// Make the final reads of one key return its first acknowledged write, as if every
		// later acknowledged write had been lost.
		keys := make([]string, 0, len(finalIdx))
		for k := range finalIdx {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			var first *porcupine.Operation
			later := false
			for i := range history {
				in, out := history[i].Input.(kvInput), history[i].Output.(kvOutput)
				if in.Key != k || out.Unknown || !(in.Kind == opPut || (in.Kind == opCAS && out.Succeeded)) {
					continue
				}
				if first == nil {
					first = &history[i]
				} else if history[i].Call > first.Return {
					later = true
				}
			}
			if first == nil || !later {
				continue
			}
			stale := kvOutput{Found: true, Value: first.Input.(kvInput).Value}
			for _, i := range finalIdx[k] {
				history[i].Output = stale
			}
			finals[k] = stale
			fmt.Fprintf(os.Stderr, "keelcheck: inject-bug: final reads of %s now return its first write %q\n", k, stale.Value)
			return
		}
		fmt.Fprintln(os.Stderr, "keelcheck: inject-bug: no key with two ordered acknowledged writes")
	}
}

// injectHeaderBug lowers the recorded header revision of one answer that carries a key below
// that key's mod_revision (issue 36's bug), to show that the header checks catch it.
func injectHeaderBug(answers []answer) {
	for i := len(answers) / 2; i < len(answers); i++ {
		if a := &answers[i]; a.MaxModAt != "" && a.MaxMod > 1 {
			a.Rev = a.MaxMod - 1
			fmt.Fprintf(os.Stderr, "keelcheck: inject-bug: %s's header revision now %d, below %s's %d\n", a.Op, a.Rev, a.MaxModAt, a.MaxMod)
			return
		}
	}
	fmt.Fprintln(os.Stderr, "keelcheck: inject-bug: no answer with a key to corrupt")
}

type historyRecord struct {
	Client int      `json:"client"`
	Call   int64    `json:"call_ns"`
	Return int64    `json:"return_ns"` // max int64 for an unknown outcome
	Input  kvInput  `json:"input"`
	Output kvOutput `json:"output"`
}

func writeHistory(path string, history []porcupine.Operation) {
	f, err := os.Create(path)
	if err != nil {
		fmt.Fprintln(os.Stderr, "keelcheck: history:", err)
		return
	}
	defer f.Close()
	enc := json.NewEncoder(f)
	for _, op := range history {
		_ = enc.Encode(historyRecord{op.ClientId, op.Call, op.Return, op.Input.(kvInput), op.Output.(kvOutput)})
	}
}
