// Command keelcheck checks an etcd-v3-API server (real etcd, or `keel serve`) for
// linearizability under process faults (`keelcheck fault`) and for etcd KV semantics
// (`keelcheck compat`). It talks to 127.0.0.1, or with `fault --netns` to members in network
// namespaces it made itself.
package main

import (
	"fmt"
	"os"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
)

func usage() {
	fmt.Fprintf(os.Stderr, `usage:
  keelcheck fault --server-bin PATH [--nodes 3] [--rounds 5] [--round-secs 10] [--clients 8]
                  [--keys 10] --workdir DIR [--base-port 23790] [--seed N]
                  [--faults kill-leader,kill-follower,kill-all,restart] [--server-arg ARG]...
                  [--netns [--partition-time 5s]]   (root: members in network namespaces,
                  faults isolate-leader,isolate-follower,isolate-kill-leader,split,bridge,one-way,delay)
  keelcheck compat --endpoints 127.0.0.1:2379,... [--expect-members N]
Run "keelcheck fault -h" or "keelcheck compat -h" for every flag.
`)
}

func main() {
	if len(os.Args) < 2 {
		usage()
		os.Exit(2)
	}
	switch os.Args[1] {
	case "fault":
		os.Exit(runFault(os.Args[2:]))
	case "compat":
		os.Exit(runCompat(os.Args[2:]))
	case "-h", "--help", "help":
		usage()
	default:
		fmt.Fprintf(os.Stderr, "keelcheck: unknown command %q\n", os.Args[1])
		usage()
		os.Exit(2)
	}
}

// clientDialOptions are added to every client; --netns sets a dialer that makes client
// sockets inside the lab's hub namespace.
var clientDialOptions []grpc.DialOption

func newClient(endpoints []string, dialTimeout time.Duration) (*clientv3.Client, error) {
	return clientv3.New(clientv3.Config{
		Endpoints:   endpoints,
		DialTimeout: dialTimeout,
		Logger:      zap.NewNop(),
		DialOptions: append([]grpc.DialOption{}, clientDialOptions...),
	})
}
