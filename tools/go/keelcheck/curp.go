package main

// A CURP client of keel's `keelcurp.Curp` extension, for the fault workload's --curp-percent:
// a put is proposed to the leader and recorded with every other voter's witness at once; it
// completes on the fast path when the leader answered speculatively in the client's term and
// superquorum - 1 witnesses accepted it in that term, else once it has applied (WaitSynced).
// Every fast-path acknowledgement goes into the porcupine history like any other put, so a fast
// write lost with a killed leader, or applied twice, is a linearizability violation.
//
// The messages are written here from keel-curp's definitions (crates/keel-curp/src/lib.rs) with
// protowire; no generated code.

import (
	"context"
	"errors"
	"fmt"
	"math/rand"
	"strings"
	"sync"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding"
	"google.golang.org/protobuf/encoding/protowire"
)

// rawCodec sends and receives message bytes as they are (the messages are encoded by hand).
type rawCodec struct{}

func (rawCodec) Marshal(v interface{}) ([]byte, error) {
	b, ok := v.(*[]byte)
	if !ok {
		return nil, fmt.Errorf("rawCodec: %T", v)
	}
	return *b, nil
}

func (rawCodec) Unmarshal(data []byte, v interface{}) error {
	b, ok := v.(*[]byte)
	if !ok {
		return fmt.Errorf("rawCodec: %T", v)
	}
	*b = append((*b)[:0], data...)
	return nil
}

func (rawCodec) Name() string { return "proto" }

var _ encoding.Codec = rawCodec{}

const (
	curpSpeculative = 0
	curpSynced      = 1
	curpNotLeader   = 2
)

type commandMsg struct {
	client, seq, firstIncomplete, term uint64
	body                               []byte
}

func (m commandMsg) encode() []byte {
	var b []byte
	b = protowire.AppendTag(b, 1, protowire.VarintType)
	b = protowire.AppendVarint(b, m.client)
	b = protowire.AppendTag(b, 2, protowire.VarintType)
	b = protowire.AppendVarint(b, m.seq)
	b = protowire.AppendTag(b, 3, protowire.VarintType)
	b = protowire.AppendVarint(b, m.firstIncomplete)
	b = protowire.AppendTag(b, 4, protowire.VarintType)
	b = protowire.AppendVarint(b, 1) // Put
	b = protowire.AppendTag(b, 5, protowire.BytesType)
	b = protowire.AppendBytes(b, m.body)
	if m.term != 0 {
		b = protowire.AppendTag(b, 6, protowire.VarintType)
		b = protowire.AppendVarint(b, m.term)
	}
	return b
}

type proposeReply struct {
	status int64
	term   uint64
	leader uint64
	voters []uint64
}

type recordReply struct {
	accepted bool
	fence    uint64
}

// fields walks a message's fields: varints (and packed varints, for repeated fields) to fn.
func fields(b []byte, fn func(num protowire.Number, v uint64)) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		switch typ {
		case protowire.VarintType:
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return protowire.ParseError(n)
			}
			fn(num, v)
			b = b[n:]
		case protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return protowire.ParseError(n)
			}
			if num == 5 { // ProposeReply.voters, packed
				for len(v) > 0 {
					x, m := protowire.ConsumeVarint(v)
					if m < 0 {
						return protowire.ParseError(m)
					}
					fn(num, x)
					v = v[m:]
				}
			}
			b = b[n:]
		default:
			n := protowire.ConsumeFieldValue(num, typ, b)
			if n < 0 {
				return protowire.ParseError(n)
			}
			b = b[n:]
		}
	}
	return nil
}

// curpClient is one CURP session (one client id, sequence numbers from 1).
type curpClient struct {
	members []curpMember
	id      uint64
	seq     uint64
	term    uint64
	leader  int
	fast    int
	slow    int
}

type curpMember struct {
	id   uint64
	conn *grpc.ClientConn
}

var curpConns sync.Map // client URL -> *grpc.ClientConn, shared by the sessions

func newCurpClient(ctx context.Context, cli *clientv3.Client, rng *rand.Rand) (*curpClient, error) {
	resp, err := cli.MemberList(ctx)
	if err != nil {
		return nil, err
	}
	c := &curpClient{id: rng.Uint64() | 1}
	for _, m := range resp.Members {
		if m.IsLearner || len(m.ClientURLs) == 0 {
			continue
		}
		url := m.ClientURLs[0]
		conn, ok := curpConns.Load(url)
		if !ok {
			addr := strings.TrimPrefix(strings.TrimPrefix(url, "http://"), "https://")
			opts := append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, clientDialOptions...)
			cc, err := grpc.NewClient(addr, opts...)
			if err != nil {
				return nil, err
			}
			conn, _ = curpConns.LoadOrStore(url, cc)
		}
		c.members = append(c.members, curpMember{id: m.ID, conn: conn.(*grpc.ClientConn)})
	}
	if len(c.members) == 0 {
		return nil, errors.New("curp: the member list names no voter with a client URL")
	}
	return c, nil
}

func invoke(ctx context.Context, conn *grpc.ClientConn, method string, req []byte) ([]byte, error) {
	var out []byte
	err := conn.Invoke(ctx, "/keelcurp.Curp/"+method, &req, &out, grpc.ForceCodec(rawCodec{}))
	return out, err
}

func superquorum(n int) int {
	f := (n - 1) / 2
	return f + (f+1)/2 + 1
}

// bytesField returns the last occurrence of length-delimited field num of a message (nil if
// absent).
func bytesField(b []byte, num protowire.Number) ([]byte, error) {
	var found []byte
	for len(b) > 0 {
		n, typ, m := protowire.ConsumeTag(b)
		if m < 0 {
			return nil, protowire.ParseError(m)
		}
		b = b[m:]
		if n == num && typ == protowire.BytesType {
			v, k := protowire.ConsumeBytes(b)
			if k < 0 {
				return nil, protowire.ParseError(k)
			}
			found = v
		}
		k := protowire.ConsumeFieldValue(n, typ, b)
		if k < 0 {
			return nil, protowire.ParseError(k)
		}
		b = b[k:]
	}
	return found, nil
}

// putResult decodes the etcd PutResponse in field num of a CURP reply (ProposeReply.result is
// 4, SyncedReply.result is 1).
func putResult(reply []byte, num protowire.Number) (*pb.PutResponse, error) {
	b, err := bytesField(reply, num)
	if err != nil {
		return nil, err
	}
	resp := &pb.PutResponse{}
	if err := resp.Unmarshal(b); err != nil {
		return nil, fmt.Errorf("curp: put result: %w", err)
	}
	return resp, nil
}

// put writes key=value as one CURP command; it retries the same command (it applies once)
// until ctx ends. fast reports the path, resp is the answer the path gave (a speculative one
// on the fast path); an error means the outcome is unknown.
func (c *curpClient) put(ctx context.Context, key, value string) (fast bool, resp *pb.PutResponse, err error) {
	c.seq++
	body, err := (&pb.PutRequest{Key: []byte(key), Value: []byte(value)}).Marshal()
	if err != nil {
		return false, nil, err
	}
	for attempt := 0; ; attempt++ {
		if ctx.Err() != nil {
			return false, nil, ctx.Err()
		}
		msg := commandMsg{client: c.id, seq: c.seq, firstIncomplete: c.seq, term: c.term, body: body}
		req := msg.encode()
		leader := c.members[c.leader%len(c.members)]
		type rec struct {
			r   recordReply
			err error
		}
		records := make(chan rec, len(c.members))
		for _, m := range c.members {
			if m.id == leader.id {
				continue
			}
			go func(m curpMember) {
				out, err := invoke(ctx, m.conn, "Record", req)
				var r recordReply
				if err == nil {
					err = fields(out, func(num protowire.Number, v uint64) {
						switch num {
						case 1:
							r.accepted = v != 0
						case 2:
							r.fence = v
						}
					})
				}
				records <- rec{r, err}
			}(m)
		}
		out, err := invoke(ctx, leader.conn, "Propose", req)
		if err != nil {
			c.leader++
			time.Sleep(time.Duration(10*(attempt+1)) * time.Millisecond)
			continue
		}
		var pr proposeReply
		if err := fields(out, func(num protowire.Number, v uint64) {
			switch num {
			case 1:
				pr.status = int64(v)
			case 2:
				pr.term = v
			case 3:
				pr.leader = v
			case 5:
				pr.voters = append(pr.voters, v)
			}
		}); err != nil {
			return false, nil, err
		}
		if pr.term > c.term {
			c.term = pr.term
		}
		switch pr.status {
		case curpSynced:
			resp, err := putResult(out, 4)
			if err != nil {
				return false, nil, err
			}
			c.slow++
			return false, resp, nil
		case curpNotLeader:
			c.leader++
			for i, m := range c.members {
				if m.id == pr.leader {
					c.leader = i
				}
			}
			time.Sleep(time.Duration(10*(attempt+1)) * time.Millisecond)
			continue
		case curpSpeculative:
		default:
			return false, nil, fmt.Errorf("curp: unknown propose status %d", pr.status)
		}
		if pr.term == msg.term {
			needed := superquorum(len(pr.voters)) - 1
			accepted := 0
			for i := 0; i < len(c.members)-1 && accepted < needed; i++ {
				r := <-records
				if r.err == nil && r.r.accepted {
					accepted++
				} else if r.err == nil && r.r.fence > c.term {
					c.term = r.r.fence
				}
			}
			if accepted >= needed {
				resp, err := putResult(out, 4)
				if err != nil {
					return false, nil, err
				}
				c.fast++
				return true, resp, nil
			}
		}
		// Slow path: it is in the leader's log; wait until it has applied.
		var w []byte
		w = protowire.AppendTag(w, 1, protowire.VarintType)
		w = protowire.AppendVarint(w, c.id)
		w = protowire.AppendTag(w, 2, protowire.VarintType)
		w = protowire.AppendVarint(w, c.seq)
		if synced, err := invoke(ctx, leader.conn, "WaitSynced", w); err == nil {
			resp, err := putResult(synced, 1)
			if err != nil {
				return false, nil, err
			}
			c.slow++
			return false, resp, nil
		}
		c.leader++
	}
}
