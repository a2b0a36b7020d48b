// Command kubelet-client plays the kubelet's side of the DRA gRPC API against one plugin,
// for the benchmarks: it holds one grpc-go ClientConn (insecure, unix socket), as the
// kubelet's DRA plugin manager does, and times NodePrepareResources /
// NodeUnprepareResources calls. It only measures: it never registers with the plugin
// (the caller found the DRA socket already) and changes nothing but the claims it is given.
//
// Stdin: a JSON array of claims, [{"namespace": ..., "name": ..., "uid": ...}, ...], at
// least -width of them (may be empty with -only-empty). With -api-server it also times
// GETs of those claims from the API server, as the plugin makes them, so that the
// benchmark knows what the API server alone allows. Stdout: one JSON object, phase
// name -> latency of each call in seconds. Progress and errors go to stderr; any failed
// call or any claim missing from an answer or answered with an error exits 1.
//
// With -side-call PATH it measures nothing: it calls PATH (any method path, unknown ones
// included) on the same connection while a NodePrepareResources of the first claim on
// stdin is in flight, and prints {"side_call": {"code", "message_bytes", "message_head"},
// "prepare": {"ok", "error"}}; it exits 0 whatever the calls answered. The tests use it
// to check that an answer to one call (a long error status, say) cannot break the
// kubelet's connection and with it the calls in flight on it.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	drav1 "k8s.io/kubelet/pkg/apis/dra/v1"
)

// callTimeout is the deadline of every call.
const callTimeout = 30 * time.Second

// warmups is the number of untimed calls (or prepare/unprepare cycles) before a sequential phase.
const warmups = 10

type claimRef struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	UID       string `json:"uid"`
}

func fatalf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "kubelet-client: "+format+"\n", args...)
	os.Exit(1)
}

func progressf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "kubelet-client: "+format+"\n", args...)
}

// client is the one connection to the plugin and the calls the benchmark makes on it.
type client struct {
	dra drav1.DRAPluginClient
}

func toProto(claims []claimRef) []*drav1.Claim {
	out := make([]*drav1.Claim, len(claims))
	for i, c := range claims {
		out[i] = &drav1.Claim{Namespace: c.Namespace, Name: c.Name, Uid: c.UID}
	}
	return out
}

// prepare calls NodePrepareResources for claims and returns the time the RPC took. Any
// error, a claim missing from the answer or a claim answered with an error is returned
// as an error.
func (c *client) prepare(claims []claimRef, opts ...grpc.CallOption) (time.Duration, error) {
	req := &drav1.NodePrepareResourcesRequest{Claims: toProto(claims)}
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	start := time.Now()
	resp, err := c.dra.NodePrepareResources(ctx, req, opts...)
	took := time.Since(start)
	if err != nil {
		return took, fmt.Errorf("NodePrepareResources of %d claim(s) %v: %w", len(claims), claims, err)
	}
	return took, checkAnswers("NodePrepareResources", claims, resp.GetClaims())
}

// unprepare is prepare's counterpart for NodeUnprepareResources.
func (c *client) unprepare(claims []claimRef) (time.Duration, error) {
	req := &drav1.NodeUnprepareResourcesRequest{Claims: toProto(claims)}
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	start := time.Now()
	resp, err := c.dra.NodeUnprepareResources(ctx, req)
	took := time.Since(start)
	if err != nil {
		return took, fmt.Errorf("NodeUnprepareResources of %d claim(s) %v: %w", len(claims), claims, err)
	}
	return took, checkAnswers("NodeUnprepareResources", claims, resp.GetClaims())
}

// checkAnswers: every claim has an answer, and none is an error.
func checkAnswers[A interface{ GetError() string }](method string, claims []claimRef, answers map[string]A) error {
	for _, claim := range claims {
		result, ok := answers[claim.UID]
		if !ok {
			return fmt.Errorf("%s: claim %s/%s (uid %s) missing from the answer",
				method, claim.Namespace, claim.Name, claim.UID)
		}
		if e := result.GetError(); e != "" {
			return fmt.Errorf("%s: claim %s/%s (uid %s): %s", method, claim.Namespace, claim.Name, claim.UID, e)
		}
	}
	return nil
}

// together runs call(0) .. call(width-1), each in its own goroutine, released at once
// when all of them are started, and returns when all have returned: the latency of each
// in order. The first error is fatal.
func together(width int, call func(i int) (time.Duration, error)) []float64 {
	var ready, done sync.WaitGroup
	release := make(chan struct{})
	took := make([]time.Duration, width)
	errs := make([]error, width)
	ready.Add(width)
	done.Add(width)
	for i := range width {
		go func() {
			defer done.Done()
			ready.Done()
			<-release
			took[i], errs[i] = call(i)
		}()
	}
	ready.Wait()
	close(release)
	done.Wait()
	out := make([]float64, width)
	for i := range width {
		if errs[i] != nil {
			fatalf("%v", errs[i])
		}
		out[i] = took[i].Seconds()
	}
	return out
}

// claimGetter GETs claims from the API server as the plugin does before a Prepare: one
// keep-alive HTTP/1.1 connection per simultaneous request, JSON, a bearer token. It gives
// the benchmark the API server's own figure for 1 and for -width simultaneous GETs.
type claimGetter struct {
	server, token string
	http          *http.Client
}

func newClaimGetter(server, caFile, tokenFile string, width int) *claimGetter {
	ca, err := os.ReadFile(caFile)
	if err != nil {
		fatalf("-api-ca: %v", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		fatalf("-api-ca %s: no PEM certificate in it", caFile)
	}
	token, err := os.ReadFile(tokenFile)
	if err != nil {
		fatalf("-api-token-file: %v", err)
	}
	transport := &http.Transport{
		TLSClientConfig:     &tls.Config{RootCAs: pool},
		MaxIdleConnsPerHost: width,
		TLSNextProto:        map[string]func(string, *tls.Conn) http.RoundTripper{}, // HTTP/1.1, as ours
	}
	return &claimGetter{strings.TrimRight(server, "/"), strings.TrimSpace(string(token)), &http.Client{Transport: transport}}
}

func (g *claimGetter) get(c claimRef) (time.Duration, error) {
	url := fmt.Sprintf("%s/apis/resource.k8s.io/v1/namespaces/%s/resourceclaims/%s", g.server, c.Namespace, c.Name)
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	req.Header.Set("Authorization", "Bearer "+g.token)
	req.Header.Set("Accept", "application/json")
	start := time.Now()
	resp, err := g.http.Do(req)
	if err != nil {
		return time.Since(start), fmt.Errorf("GET %s: %w", url, err)
	}
	_, err = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	took := time.Since(start)
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return took, err
}

func must(took time.Duration, err error) float64 {
	if err != nil {
		fatalf("%v", err)
	}
	return took.Seconds()
}

func readClaims() []claimRef {
	var claims []claimRef
	dec := json.NewDecoder(os.Stdin)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&claims); err != nil {
		fatalf("stdin: want a JSON array of {\"namespace\", \"name\", \"uid\"} claims: %v", err)
	}
	seen := map[string]bool{}
	for i, c := range claims {
		if c.Namespace == "" || c.Name == "" || c.UID == "" {
			fatalf("stdin: claim %d (%+v) needs a namespace, a name and a uid", i, c)
		}
		if seen[c.UID] {
			fatalf("stdin: claim %d (%+v): uid given twice", i, c)
		}
		seen[c.UID] = true
	}
	return claims
}

// sideCallResult is what -side-call prints.
type sideCallResult struct {
	SideCall struct {
		Code         string `json:"code"`
		MessageBytes int    `json:"message_bytes"`
		MessageHead  string `json:"message_head"`
	} `json:"side_call"`
	Prepare struct {
		OK    bool   `json:"ok"`
		Error string `json:"error"`
	} `json:"prepare"`
}

// sideCall calls path with an empty NodePrepareResourcesRequest while a
// NodePrepareResources of claim is in flight on the same connection (started `lead`
// before), and reports how both ended.
func sideCall(conn *grpc.ClientConn, c *client, claim claimRef, path string, lead time.Duration) sideCallResult {
	var out sideCallResult
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		_, err := c.prepare([]claimRef{claim}, grpc.WaitForReady(true))
		out.Prepare.OK = err == nil
		if err != nil {
			out.Prepare.Error = err.Error()
		}
	}()
	time.Sleep(lead)
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	err := conn.Invoke(ctx, path, &drav1.NodePrepareResourcesRequest{}, &drav1.NodePrepareResourcesResponse{},
		grpc.WaitForReady(true))
	st := status.Convert(err)
	out.SideCall.Code = st.Code().String()
	out.SideCall.MessageBytes = len(st.Message())
	head := st.Message()
	if len(head) > 200 {
		head = head[:200]
	}
	out.SideCall.MessageHead = head
	wg.Wait()
	return out
}

func main() {
	socket := flag.String("socket", "", "unix socket of the plugin's DRA service (required)")
	rounds := flag.Int("rounds", 200, "timed calls (or prepare/unprepare cycles) of each sequential phase")
	concurrentRounds := flag.Int("concurrent-rounds", 20, "rounds of -width simultaneous calls of each concurrent phase")
	width := flag.Int("width", 16, "simultaneous calls in a concurrent round; claims needed on stdin")
	onlyEmpty := flag.Bool("only-empty", false, "run only the empty-call phases (no claims needed)")
	apiServer := flag.String("api-server", "", "with -api-ca and -api-token-file: also time GETs of the claims from this API server")
	apiCA := flag.String("api-ca", "", "CA bundle of -api-server")
	apiTokenFile := flag.String("api-token-file", "", "file holding a bearer token for -api-server")
	sideCallPath := flag.String("side-call", "", "call this method path while a prepare of the first claim is in flight; report both (no timing)")
	sideCallLead := flag.Duration("side-call-lead", 300*time.Millisecond, "with -side-call: how long after the prepare started to make the side call")
	flag.Parse()
	if *socket == "" || flag.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "usage: kubelet-client -socket PATH [flags] < claims.json")
		flag.PrintDefaults()
		os.Exit(2)
	}
	if *rounds < 1 || *concurrentRounds < 1 || *width < 1 {
		fatalf("-rounds, -concurrent-rounds and -width must be at least 1")
	}
	claims := readClaims()
	if *sideCallPath != "" {
		if len(claims) < 1 {
			fatalf("-side-call needs a claim on stdin for the prepare in flight")
		}
		conn, err := grpc.NewClient("unix://"+*socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			fatalf("connection to %s: %v", *socket, err)
		}
		result := sideCall(conn, &client{dra: drav1.NewDRAPluginClient(conn)}, claims[0], *sideCallPath, *sideCallLead)
		_ = conn.Close()
		if err := json.NewEncoder(os.Stdout).Encode(result); err != nil {
			fatalf("stdout: %v", err)
		}
		return
	}
	if !*onlyEmpty && len(claims) < *width {
		fatalf("stdin has %d claim(s), -width %d needs at least %d (or -only-empty)", len(claims), *width, *width)
	}

	// One connection for everything, as the kubelet keeps one per plugin: created lazily
	// by grpc.NewClient, connected by the first call.
	conn, err := grpc.NewClient("unix://"+*socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fatalf("connection to %s: %v", *socket, err)
	}
	defer func() { _ = conn.Close() }()
	c := &client{dra: drav1.NewDRAPluginClient(conn)}
	out := map[string][]float64{}

	// Phase 1: empty calls. The first warm-up waits for the socket to accept (within the
	// call's deadline), so a server that is still starting is not an error.
	progressf("empty: %d warm-up + %d sequential calls, %d rounds of %d concurrent", warmups, *rounds, *concurrentRounds, *width)
	must(c.prepare(nil, grpc.WaitForReady(true)))
	for range warmups - 1 {
		must(c.prepare(nil))
	}
	for range *rounds {
		out["empty"] = append(out["empty"], must(c.prepare(nil)))
	}
	for range *concurrentRounds {
		out["empty_concurrent"] = append(out["empty_concurrent"],
			together(*width, func(int) (time.Duration, error) { return c.prepare(nil) })...)
	}

	if !*onlyEmpty {
		// Phase 2: one claim at a time, each prepare followed by its unprepare.
		progressf("sequential: %d warm-up + %d prepare/unprepare cycles of claim %s/%s",
			warmups, *rounds, claims[0].Namespace, claims[0].Name)
		first := claims[:1]
		for range warmups {
			must(c.prepare(first))
			must(c.unprepare(first))
		}
		for range *rounds {
			out["prepare_sequential"] = append(out["prepare_sequential"], must(c.prepare(first)))
			out["unprepare_sequential"] = append(out["unprepare_sequential"], must(c.unprepare(first)))
		}

		// Phase 3: -width claims at once, one call each; all unprepared at once afterwards.
		progressf("concurrent: %d rounds of %d prepares then %d unprepares", *concurrentRounds, *width, *width)
		for range *concurrentRounds {
			out["prepare_concurrent"] = append(out["prepare_concurrent"],
				together(*width, func(i int) (time.Duration, error) { return c.prepare(claims[i : i+1]) })...)
			out["unprepare_concurrent"] = append(out["unprepare_concurrent"],
				together(*width, func(i int) (time.Duration, error) { return c.unprepare(claims[i : i+1]) })...)
		}
	}

	if *apiServer != "" && !*onlyEmpty {
		// Phase 4: the API server alone, the same claims: a GET of one, then -width at once.
		g := newClaimGetter(*apiServer, *apiCA, *apiTokenFile, *width)
		progressf("claim GETs: %d warm-up + %d sequential, %d rounds of %d concurrent", warmups, *rounds, *concurrentRounds, *width)
		for range warmups {
			must(g.get(claims[0]))
		}
		for range *rounds {
			out["get_sequential"] = append(out["get_sequential"], must(g.get(claims[0])))
		}
		for range *concurrentRounds {
			out["get_concurrent"] = append(out["get_concurrent"],
				together(*width, func(i int) (time.Duration, error) { return g.get(claims[i]) })...)
		}
	}

	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fatalf("stdout: %v", err)
	}
}
