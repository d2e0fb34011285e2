// Command etcdctl is etcd's own etcdctl v3 (go.etcd.io/etcd/etcdctl/v3, pinned in go.mod),
// built from the Go module proxy so KeelDB's `keel serve` can be driven by the stock client.
package main

import "go.etcd.io/etcd/etcdctl/v3/ctlv3"

func main() { ctlv3.MustStart() }
